"""relayline from a plain synchronous script: no event loop in sight.

    python examples/sync_script.py CONFIG "your question" [--stream]

Prints the answer (streamed as it arrives with --stream), then who served it. Exits 1 with the
reason when the turn did not answer; an interrupted stream keeps what was already printed.
"""

from __future__ import annotations

import sys

from relayline.adapters import Relay, StreamInterruptedAfterOutput, TurnError


def main(argv: list[str]) -> int:
    config, question, *flags = argv
    messages = [{"role": "user", "content": question}]
    with Relay.from_file(config) as relay:
        try:
            if "--stream" in flags:
                with relay.stream_sync(messages) as turn:
                    for event in turn:
                        if event.kind == "text":
                            print(event.value, end="", flush=True)
                print(f"\n[served by {turn.served}]")
            else:
                reply = relay.complete_sync(messages)
                print(reply.text)
                print(f"[served by {reply.served}]")
        except StreamInterruptedAfterOutput as exc:
            print(f"\n[interrupted after {len(exc.partial_text)} characters: not replayed]", file=sys.stderr)
            return 1
        except TurnError as exc:
            print(f"[no answer: {exc.reason}] {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
