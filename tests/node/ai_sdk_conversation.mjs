// A multi-turn, tool-using conversation with Vercel's AI SDK (its OpenAI
// Responses provider, store left at its default), history carried across
// turns with response.messages, as the AI SDK's docs show.
//
//   node ai_sdk_conversation.mjs BASE_URL [--turns N] [--stream] [--model M] [--reasoning-effort E]
//
// Prints {"requests": [{"bytes", "body"}], "answers": [final text per turn]}.

import { createOpenAI } from '@ai-sdk/openai';
import { generateText, stepCountIs, streamText, tool } from 'ai';
import { z } from 'zod';
import { driverArgs, recordingFetch, runDriver, userTurns, weatherFor } from './recording.mjs';

const { baseURL, turns, values } = driverArgs({
  model: { type: 'string', default: 'gpt-test' },
  'reasoning-effort': { type: 'string' },
});

const getWeather = tool({
  description: 'Weather for a city.',
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => weatherFor(city),
});

async function main() {
  const requests = [];
  const openai = createOpenAI({ baseURL, apiKey: 'sk-node-ai-sdk', fetch: recordingFetch(requests) });
  const effort = values['reasoning-effort'];
  const call = {
    model: openai.responses(values.model),
    system: 'You are a terse assistant.',
    tools: { get_weather: getWeather },
    stopWhen: stepCountIs(5),
    maxRetries: 0,
    ...(effort && { providerOptions: { openai: { reasoningEffort: effort, reasoningSummary: 'auto' } } }),
  };
  const messages = [];
  const answers = [];
  for (const text of userTurns(turns)) {
    messages.push({ role: 'user', content: text });
    let response;
    if (values.stream) {
      let failure;
      const result = streamText({ ...call, messages, onError: ({ error }) => { failure ??= error; } });
      await result.consumeStream();
      if (failure) throw failure;
      answers.push(await result.text);
      response = await result.response;
    } else {
      const result = await generateText({ ...call, messages });
      answers.push(result.text);
      response = result.response;
    }
    messages.push(...response.messages);
  }
  return { requests, answers };
}

runDriver(main);
