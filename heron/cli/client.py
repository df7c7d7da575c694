"""``heron encode | score | extract | models``: the SDK from a terminal. Each prints the
server's JSON answer, so the output pipes into ``jq``; an error prints its code and exits 1."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import orjson

from heron_sdk.client import Client, default_url
from heron_sdk.errors import HeronError


def _texts(args: argparse.Namespace) -> list[str]:
    """TEXT arguments; a lone ``-`` reads one text per line from stdin."""
    if args.texts == ["-"]:
        return [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return list(args.texts)


def _encode_items(args: argparse.Namespace) -> list[str | bytes]:
    """The TEXT arguments, then each ``--image FILE``'s bytes (an image model's items)."""
    items: list[str | bytes] = list(_texts(args)) if args.texts else []
    for path in args.image or ():
        try:
            with open(path, "rb") as file:
                items.append(file.read())
        except OSError as exc:
            raise SystemExit(f"heron: --image {path}: {exc.strerror or exc}") from None
    if not items:
        raise SystemExit("heron encode: give at least one TEXT or --image FILE")
    return items


def _encode(client: Client, args: argparse.Namespace) -> Any:
    return client.encode(args.model, _encode_items(args),
                         output_types=args.output_type or ["dense"],
                         output_dtype=args.dtype, dims=args.dims, is_query=args.query,
                         adapter=args.adapter, pool=args.pool).to_dict()


def _score(client: Client, args: argparse.Namespace) -> Any:
    return client.score(args.model, args.query, _texts(args), top_k=args.top_k,
                        adapter=args.adapter, pool=args.pool).to_dict()


def _extract(client: Client, args: argparse.Namespace) -> Any:
    return client.extract(args.model, _texts(args), labels=args.labels,
                          threshold=args.threshold, adapter=args.adapter,
                          pool=args.pool).to_dict()


def _models(client: Client, args: argparse.Namespace) -> Any:
    if args.model:
        return client.get_model(args.model, pool=args.pool)
    return {"object": "list", "data": client.list_models(pool=args.pool)}


def run_client_command(args: argparse.Namespace,
                       command: Callable[[Client, argparse.Namespace], Any]) -> int:
    try:
        with Client(args.url, wire="json", timeout=args.timeout,
                    provision_timeout_s=args.provision_timeout) as client:
            out = command(client, args)
    except HeronError as exc:
        where = f" ({exc.field})" if exc.field else ""
        print(f"heron: {exc.code} [{exc.status}]{where}: {exc.message}", file=sys.stderr)
        return 1
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    def parser(name: str, help_text: str,
               command: Callable[[Client, argparse.Namespace], Any],
               inference: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--url", default=default_url(),
                       help="server or gateway URL (default: HERON_URL or %(default)s)")
        p.add_argument("--pool", default=os.environ.get("HERON_POOL_NAME"),
                       help="route to this pool (X-Heron-Pool)")
        p.add_argument("--timeout", type=float, default=60.0, help="seconds for the call")
        p.add_argument("--provision-timeout", type=float, default=300.0,
                       help="seconds to wait while capacity is provisioned (202/503)")
        if inference:  # a request option of encode, score and extract
            p.add_argument("--adapter", default=None, metavar="NAME",
                           help="compute with this LoRA adapter of the model (its config's "
                                "loras; MODEL@NAME says the same)")
        p.set_defaults(func=lambda args: run_client_command(args, command))
        return p

    encode = parser("encode", "embed texts and images: heron encode MODEL TEXT... "
                              "[--image FILE]... (- reads stdin)", _encode)
    encode.add_argument("model")
    encode.add_argument("texts", nargs="*", metavar="TEXT")
    encode.add_argument("--image", action="append", metavar="FILE",
                        help="an image file (PNG, JPEG, WebP, ...), after the texts; "
                             "repeatable (image models: adapter clip)")
    encode.add_argument("--output-type", action="append",
                        choices=["dense", "sparse", "multi_vector", "muvera"],
                        help="repeatable (default: dense)")
    encode.add_argument("--dtype", default="float32",
                        choices=["float32", "float16", "int8", "uint8", "binary"])
    encode.add_argument("--dims", type=int, default=None, help="Matryoshka dimensions")
    encode.add_argument("--query", action="store_true",
                        help="texts are queries (the profile's query instruction)")

    score = parser("score", "rank texts against a query: heron score MODEL QUERY TEXT...",
                   _score)
    score.add_argument("model")
    score.add_argument("query")
    score.add_argument("texts", nargs="+", metavar="TEXT")
    score.add_argument("--top-k", type=int, default=None)

    extract = parser("extract", "entities in texts: heron extract MODEL TEXT... "
                                "[--labels PER LOC]", _extract)
    extract.add_argument("model")
    extract.add_argument("texts", nargs="+", metavar="TEXT")
    extract.add_argument("--labels", nargs="+", default=None)
    extract.add_argument("--threshold", type=float, default=0.0)

    models = parser("models", "list the models (or describe one): heron models [MODEL]",
                    _models, inference=False)
    models.add_argument("model", nargs="?")
