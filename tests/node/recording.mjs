// What the Node drivers share: the conversation's user turns, a fetch that
// records every Responses request body before it leaves the process, and
// the JSON report on stdout.

import { parseArgs } from 'node:util';

/** The base URL (the proxy's, with /v1) and the options every driver takes. */
export function driverArgs(extraOptions = {}) {
  const { positionals, values } = parseArgs({
    allowPositionals: true,
    options: {
      turns: { type: 'string', default: '12' },
      stream: { type: 'boolean', default: false },
      ...extraOptions,
    },
  });
  if (positionals.length !== 1) {
    throw new Error('usage: node DRIVER.mjs BASE_URL [--turns N] [--stream]');
  }
  return { baseURL: positionals[0], turns: Number(values.turns), values };
}

/** n user turns; every third asks for a tool call the emulator's model makes
 * (it calls NAME when the newest user message says call:NAME({json})). */
export function userTurns(n) {
  return Array.from({ length: n }, (_, i) =>
    i % 3 === 1
      ? `turn ${i}: call:get_weather({"city": "City${i}"})`
      : `turn ${i}: tell me something about the number ${i}.`,
  );
}

export function weatherFor(city) {
  return { city, temp_c: 21 };
}

/** A fetch that keeps each /responses request body exactly as sent (the
 * client's meaning, captured before the proxy can change anything). */
export function recordingFetch(requests) {
  return async (url, init) => {
    if (String(url).endsWith('/responses')) {
      if (typeof init?.body !== 'string') {
        throw new Error(`unexpected request body type: ${typeof init?.body}`);
      }
      requests.push({ bytes: Buffer.byteLength(init.body), body: JSON.parse(init.body) });
    }
    return fetch(url, init);
  };
}

/** Run ``main`` and print its report as JSON; any error exits non-zero. */
export function runDriver(main) {
  main().then(
    (report) => process.stdout.write(JSON.stringify(report) + '\n'),
    (error) => {
      console.error(error?.stack ?? error);
      process.exit(1);
    },
  );
}
