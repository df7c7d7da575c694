"""The mosec peer: a mosec ``Worker`` with mosec's dynamic batching (Rust HTTP front end).

One worker process, batches of up to ``--batch-size`` texts, ``max_wait_time``
``--batch-wait-ms`` (mosec's default is 10 ms), JSON in and out (mosec's default, but
compact: mosec's own ``serialize`` indents, which triples a 384-float response).

    POST /inference {"text": "..."} -> {"embedding": [384 floats]}
"""

from __future__ import annotations

import json
import sys

import peer_common

ARGS = peer_common.parse_args(__doc__ or "")

from mosec import Server, Worker  # noqa: E402


class Encoder(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.model = peer_common.load_model(ARGS.model, ARGS.precision)

    def forward(self, data: list[dict]) -> list[dict]:
        vectors = self.model.encode([item["text"] for item in data], batch_size=len(data))
        return [{"embedding": v} for v in vectors.tolist()]

    def serialize(self, data: dict) -> bytes:
        return json.dumps(data, separators=(",", ":")).encode()


if __name__ == "__main__":
    # mosec reads its own options from argv (--port is shared): address, a generous
    # timeout. Appended, not replaced: the spawned worker parses the same argv for ours.
    sys.argv += ["--address", ARGS.host, "--timeout", "60000", "--log-level", "warning"]
    server = Server()
    server.append_worker(Encoder, num=1, max_batch_size=ARGS.batch_size,
                         max_wait_time=max(1, round(ARGS.batch_wait_ms)))
    server.run()
