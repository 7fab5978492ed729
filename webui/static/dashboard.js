// The dashboard's entry point: the chat on one side, the live swarm on the other.
import {initChat, refreshModels} from "./chat.js";
import {initSwarm, markMine} from "./swarm.js";
import {$} from "./ui.js";
import {askForKey, setApiKey} from "./net.js";

function bindKeyButton() {
  $("key-button").addEventListener("click", async () => {
    if (await askForKey("The key is kept in this browser and sent as 'Authorization: Bearer'.")) {
      location.reload(); // reconnect everything with the new key
    }
  });
  $("key-clear").addEventListener("click", () => {
    setApiKey("");
    $("key-input").value = "";
  });
}

bindKeyButton();
initChat({onRequest: markMine});
initSwarm({onPlans: refreshModels});
