"""A long prompt's prefill on the dashboard, in a real browser: the chat bubble and the Call wall
show tokens done / total while the route prefills, then the reply streams as usual.

The swarm of tests/test_dashboard_browser.py (a tiny llama split over two nodes in threads,
the tail gated): the head runs its slices of the prompt and reports them, the gated tail
runs nothing, so the prefill stays half done until the test lets the tail go.
"""
from __future__ import annotations

import re

from tests.test_dashboard_browser import WAIT_MS, reply_text, set_settings, shot, swarm  # noqa: F401  (swarm is a fixture)

PROMPT = " ".join(["the quick brown fox jumps over the lazy dog, meshnet splits a model across nodes."] * 12)


def test_a_long_prompt_shows_its_prefill_in_the_bubble_and_on_the_call_wall(browser, swarm):  # noqa: F811  (swarm)
    cluster, model, gate, webui = swarm
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(webui.url)
    page.wait_for_function("m => document.querySelector('#model').value === m", arg=model, timeout=WAIT_MS)
    set_settings(page, temperature=0, max_tokens=4)
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")
    bubble = page.locator("#messages .msg.assistant:last-child .meta")
    bubble.filter(has_text="reading the prompt").wait_for(timeout=WAIT_MS)
    done, total = map(int, re.search(r"reading the prompt… (\d+) / (\d+) tokens", bubble.inner_text()).groups())
    assert 0 < done < total  # the head's half of the layers ran, the tail's did not
    assert page.inner_text("#chat-status").startswith("reading the prompt…")
    wall = page.locator("#calls-active .call.mine .prefill")
    wall.wait_for(timeout=WAIT_MS)
    assert re.fullmatch(rf"prefill \d+ / {total}", wall.inner_text().strip())
    assert int(wall.locator("progress").get_attribute("max")) == total
    shot(page, "dashboard-prefill")
    gate.open()
    page.wait_for_function("() => document.querySelector('#send').textContent === 'Send'", timeout=WAIT_MS)
    assert reply_text(page) and "reading the prompt" not in page.locator("#messages .msg.assistant:last-child").inner_text()
    page.close()
