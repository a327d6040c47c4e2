"""``python -m stateful_responses.emulator [--port N] [--port-file F]``: serve until killed."""

import argparse
import signal
import threading

from .server import Emulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Emulator(args.host, args.port, certfile=args.certfile, keyfile=args.keyfile) as emu:
        if args.port_file:
            with open(args.port_file, "w") as f:
                f.write(str(emu.port))
        print(f"responses emulator listening on {emu.url}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
