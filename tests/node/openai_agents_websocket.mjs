// OpenAI's TypeScript Agents SDK over its Responses WebSocket transport
// (useResponsesWebSocket), a run per socket: the second run resends the
// first's history whole, the third goes on from the second's last response
// by id. It ignores HTTPS_PROXY: reverse mode only.
//
//   node openai_agents_websocket.mjs BASE_URL
//
// Prints {"ids": [each run's last response id]}.

import { Agent, OpenAIProvider, Runner, setTracingDisabled, tool, user } from '@openai/agents';
import OpenAI from 'openai';
import { z } from 'zod';
import { driverArgs, runDriver, weatherFor } from './recording.mjs';

const { baseURL } = driverArgs();

setTracingDisabled(true); // tracing would export to api.openai.com

const getWeather = tool({
  name: 'get_weather',
  description: 'Weather for a city.',
  parameters: z.object({ city: z.string() }),
  execute: async ({ city }) => JSON.stringify(weatherFor(city)),
});

async function run(input, options = {}) {
  const client = new OpenAI({ baseURL, apiKey: 'sk-node-ws', maxRetries: 0 });
  const provider = new OpenAIProvider({ openAIClient: client, useResponses: true, useResponsesWebSocket: true });
  const runner = new Runner({ modelProvider: provider, tracingDisabled: true });
  const agent = new Agent({ name: 'assistant', instructions: 'Be terse.', model: 'gpt-test', tools: [getWeather] });
  try {
    return await runner.run(agent, input, options);
  } finally {
    await provider.close?.();
  }
}

async function main() {
  const first = await run('call:get_weather({"city": "Paris"})');
  const second = await run([...first.history, user('call:get_weather({"city": "Rome"})')]);
  const third = await run('call:get_weather({"city": "Oslo"})', { previousResponseId: second.lastResponseId });
  return { ids: [first.lastResponseId, second.lastResponseId, third.lastResponseId] };
}

runDriver(main);
