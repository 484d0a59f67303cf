// The chat page: streams replies from /v1/chat/completions (server-sent events read with
// fetch), a Stop button that aborts the request (the server then frees its pages), and the
// model's name from /v1/models. No build step and nothing from a CDN.
"use strict";

const $ = (id) => document.getElementById(id);
const history = []; // the conversation sent with each request: {role, content}
let model = null;
let controller = null; // the AbortController of the reply being streamed, if any

async function loadModel() {
  try {
    const response = await fetch("v1/models");
    const body = await response.json();
    model = body.data[0].id;
    $("model-name").textContent = model;
  } catch (err) {
    $("model-name").textContent = "model unknown";
    setStatus(`could not read /v1/models: ${err}`);
  }
}

function setStatus(text) {
  $("status").textContent = text;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text; // never innerHTML: replies are untrusted text
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function addNote(div, text) {
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = text;
  div.appendChild(note);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Yields the JSON payload of each `data:` event of an SSE stream until [DONE].
async function* serverSentEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || body.detail || JSON.stringify(body);
  } catch {
    return response.statusText;
  }
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  controller = new AbortController();
  setBusy(true);
  setStatus("generating…");
  let content = "";
  let finish = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      signal: controller.signal,
      body: JSON.stringify({
        model: model,
        messages: history,
        stream: true,
        temperature: Number($("temperature").value),
        max_tokens: Number($("max-tokens").value),
      }),
    });
    if (!response.ok) throw new Error(`${response.status}: ${await errorText(response)}`);
    for await (const chunk of serverSentEvents(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      content += (choice.delta && choice.delta.content) || "";
      reply.textContent = content;
      reply.scrollIntoView({ block: "end" });
      finish = choice.finish_reason || finish;
    }
    setStatus(finish ? `finished: ${finish}` : "");
  } catch (err) {
    if (err.name === "AbortError") {
      addNote(reply, "(stopped)");
      setStatus("stopped");
    } else {
      reply.className = "message error";
      reply.textContent = content + (content ? "\n" : "") + String(err.message || err);
      setStatus("error");
    }
  } finally {
    if (content) history.push({ role: "assistant", content: content });
    controller = null;
    setBusy(false);
  }
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});

$("stop").addEventListener("click", () => {
  if (controller) controller.abort();
});

$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("messages").replaceChildren();
  setStatus("");
});

loadModel();
