// Drives a server with ollama's JavaScript client (the npm package `ollama`), as an app
// written for ollama would: node ollama_js_client.cjs URL MODEL; prints one JSON object.
const { Ollama } = require("ollama");

async function main() {
  const [host, model] = process.argv.slice(2);
  const ollama = new Ollama({ host });
  const options = { num_predict: 24, temperature: 0, num_ctx: 32768, num_gpu: 99 };
  const question = { role: "user", content: "What is the capital of France?" };
  const whole = await ollama.chat({ model, messages: [question], options, keep_alive: "5m" });
  let streamed = "";
  for await (const part of await ollama.chat({ model, messages: [question], options, stream: true })) {
    streamed += part.message.content;
  }
  const weather = {
    type: "function",
    function: { name: "get_weather", description: "The weather in a city now.",
                parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } },
  };
  const called = await ollama.chat({ model, tools: [weather], options, messages: [
    { role: "user", content: "What is the weather in Paris?" },
    { role: "assistant", content: "", tool_calls: [{ function: { name: "get_weather", arguments: { city: "Paris" } } }] },
    { role: "tool", content: "sunny", tool_name: "get_weather" },
  ] });
  const generated = await ollama.generate({ model, prompt: "The capital of France is", raw: true, options });
  const shown = await ollama.show({ model });
  const ps = await ollama.ps();
  let refused = null;
  try {
    await ollama.chat({ model, messages: [question], options: { ...options, mirostat: 2 } });
  } catch (e) {
    refused = { status: e.status_code, error: e.error };
  }
  console.log(JSON.stringify({ whole: whole.message.content, done: whole.done_reason, streamed,
                               called: called.message, generated: generated.response,
                               parameters: shown.parameters, ps: ps.models, refused }));
}

main().catch((e) => { console.error(String(e)); process.exit(1); });
