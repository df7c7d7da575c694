"""The LitServe peer: a ``LitAPI`` with LitServe's dynamic batching.

One inference worker on the CPU, batches of up to ``--batch-size`` texts gathered for at
most ``--batch-wait-ms``, ZeroMQ queues (``fast_queue=True``, LitServe's advice above 100
requests/s), one API server process (the machine has 2 cores).

    POST /predict {"text": "..."} -> {"embedding": [384 floats]}
"""

from __future__ import annotations

import peer_common

ARGS = peer_common.parse_args(__doc__ or "")

import litserve as ls  # noqa: E402


class EmbeddingAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = peer_common.load_model(ARGS.model, ARGS.precision)

    def decode_request(self, request: dict) -> str:
        return request["text"]

    def predict(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(texts, batch_size=len(texts)).tolist()

    def encode_response(self, embedding: list[float]) -> dict[str, list[float]]:
        return {"embedding": embedding}


if __name__ == "__main__":
    api = EmbeddingAPI(max_batch_size=ARGS.batch_size, batch_timeout=ARGS.batch_wait_ms / 1000)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, fast_queue=True)
    server.run(host=ARGS.host, port=ARGS.port, num_api_servers=1, log_level="warning",
               generate_client_file=False)
