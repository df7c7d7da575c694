"""The plain peer: FastAPI + sentence-transformers, one ``model.encode`` per request.

No batching: this is the server most teams write first. The endpoint is a plain ``def``,
which FastAPI runs in its thread pool (the documented way to call blocking code), so
concurrent requests run concurrent single-text forward passes.

    POST /embed {"text": "..."} -> {"embedding": [384 floats]}
"""

from __future__ import annotations

import peer_common

ARGS = peer_common.parse_args(__doc__ or "", batching=False)

import uvicorn  # noqa: E402  (after peer_common set the offline environment)
from fastapi import FastAPI  # noqa: E402
from pydantic import BaseModel  # noqa: E402

model = peer_common.load_model(ARGS.model, ARGS.precision)
app = FastAPI()


class EmbedRequest(BaseModel):
    text: str


@app.post("/embed")
def embed(request: EmbedRequest) -> dict[str, list[float]]:
    return {"embedding": model.encode(request.text).tolist()}


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


if __name__ == "__main__":
    uvicorn.run(app, host=ARGS.host, port=ARGS.port, log_level="warning", access_log=False)
