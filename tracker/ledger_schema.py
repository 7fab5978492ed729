"""The ledger's tables, and the migration of a ledger an older tracker wrote."""
from __future__ import annotations

import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS completions (
    attempt TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    recorded_at REAL NOT NULL,
    model TEXT NOT NULL,
    head_node TEXT NOT NULL,
    api_key_id TEXT,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    max_tokens INTEGER NOT NULL,
    elapsed REAL NOT NULL,
    finish_reason TEXT,
    route TEXT NOT NULL,
    hops INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('billed', 'held', 'void')),
    reason TEXT NOT NULL,
    resumed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS served (
    attempt TEXT NOT NULL REFERENCES completions(attempt),
    node_id TEXT NOT NULL,
    start_layer INTEGER NOT NULL,
    end_layer INTEGER NOT NULL,
    PRIMARY KEY (attempt, node_id, start_layer)
);
CREATE INDEX IF NOT EXISTS completions_key ON completions(api_key_id, status);
CREATE INDEX IF NOT EXISTS completions_request ON completions(request_id, api_key_id);
"""

# version 1 keyed rows by the client's request id: each becomes an attempt of that id
FROM_V1 = """
ALTER TABLE completions RENAME TO completions_v1;
ALTER TABLE served RENAME TO served_v1;
DROP INDEX IF EXISTS completions_key;
{schema}
INSERT INTO completions SELECT request_id, request_id, recorded_at, model, head_node, api_key_id, prompt_tokens,
    completion_tokens, max_tokens, elapsed, finish_reason, route, hops, status, reason, 0 FROM completions_v1;
INSERT INTO served SELECT request_id, node_id, start_layer, end_layer FROM served_v1;
DROP TABLE served_v1;
DROP TABLE completions_v1;
"""


def migrate(db: sqlite3.Connection, version: int) -> None:
    """Bring ``db`` to schema ``version`` (inside the caller's transaction)."""
    if db.execute("PRAGMA user_version").fetchone()[0] == 1:
        db.executescript(FROM_V1.format(schema=SCHEMA))
    else:
        db.executescript(SCHEMA)
    db.execute(f"PRAGMA user_version={version}")
