// A multi-turn, tool-using conversation with OpenAI's TypeScript Agents SDK
// (Runner.run with a function tool over the Responses API), history carried
// across turns with result.history, as its docs show.
//
//   node openai_agents_conversation.mjs BASE_URL [--turns N] [--stream]
//
// Prints {"requests": [{"bytes", "body"}], "answers": [final output per turn]}.

import { Agent, OpenAIProvider, Runner, setTracingDisabled, tool, user } from '@openai/agents';
import OpenAI from 'openai';
import { z } from 'zod';
import { driverArgs, recordingFetch, runDriver, userTurns, weatherFor } from './recording.mjs';

const { baseURL, turns, values } = driverArgs();

setTracingDisabled(true); // tracing would export to api.openai.com

const getWeather = tool({
  name: 'get_weather',
  description: 'Weather for a city.',
  parameters: z.object({ city: z.string() }),
  execute: async ({ city }) => JSON.stringify(weatherFor(city)),
});

async function main() {
  const requests = [];
  const client = new OpenAI({ baseURL, apiKey: 'sk-node-agents', fetch: recordingFetch(requests), maxRetries: 0 });
  const runner = new Runner({
    modelProvider: new OpenAIProvider({ openAIClient: client, useResponses: true }),
    tracingDisabled: true,
  });
  const agent = new Agent({ name: 'assistant', instructions: 'You are a terse assistant.', model: 'gpt-test', tools: [getWeather] });
  let history = [];
  const answers = [];
  for (const text of userTurns(turns)) {
    const input = [...history, user(text)];
    let result;
    if (values.stream) {
      result = await runner.run(agent, input, { stream: true });
      await result.completed;
      if (result.error) throw result.error;
    } else {
      result = await runner.run(agent, input);
    }
    answers.push(result.finalOutput);
    history = result.history;
  }
  return { requests, answers };
}

runDriver(main);
