"""Fuzz every server's request parsers: N generated bodies each, no 5xx, still healthy after.

    python -m bench.fuzz [--bodies 10000] [--seed 0] [--servers serve,gateway,config]
                         [--concurrency 8] [--out DIR]
    python -m bench.fuzz --show-case gateway:1234   # one case's bytes, to replay it

Servers (each started on free 127.0.0.1 ports, stopped by PID afterwards):
- ``serve``: ``heron serve`` with the default bundle (MiniLM): /v1/encode, /v1/score and
  /v1/extract on ``minilm`` (score and extract parse, then answer 422 UNSUPPORTED_TASK), and
  /v1/embeddings.
- ``gateway``: a real nats-server, ``heron worker`` (default bundle) and ``heron gateway``:
  the same routes through the cluster, plus the pools API (POST /v1/pools, .../renew).
- ``config``: ``heron config`` with an admin token, its own nats-server and store: POST
  /v1/configs/models in JSON, msgpack and YAML.

Bodies come from bench/fuzz_bodies.py and bench/fuzz_mutations.py: valid ones drawn from
the OpenAPI document the server serves (checked equal to the one generated from the code),
and mutations of them; case ``i`` of a server is the same bytes for the same seed. Each
server gets ``--bodies`` of them, ``--concurrency`` at a time, within ``--time-limit-s``.
A failure is any 5xx (but 504 DEADLINE_EXCEEDED for a body whose own ``timeout_s`` is under
a second: the documented answer), an error answer that is not a well-formed error body, no
answer within ``--request-timeout-s`` (a hang), a broken connection (a crash), bodies left
unsent at the time limit, or a server that afterwards fails /healthz or a valid request.
Writes DIR/fuzz.json (DIR: bench/results/): per server the status histogram, per mutation
and route, wall time, and each failure with the body that caused it. Exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.fuzz_bodies import JSON, MSGPACK, YAML, Route, pattern_names
from bench.fuzz_mutations import CaseFactory, FuzzCase
from bench.server import HOST, REPO, free_port, heron_command
from heron.config_service.routes import CONFIG_OPERATIONS
from heron.gateway.routes import GATEWAY_OPERATIONS
from heron.runtime.config_api_types import MODEL_NAME_PATTERN
from heron.runtime.front import INFERENCE_OPERATIONS
from heron.runtime.openapi import ApiOperation, openapi_document
from heron_sdk import wire
from heron_sdk.errors import ErrorCode
from heron_sdk.images import IMAGE_PATTERN
from heron_sdk.pools import POOL_NAME_RE
from heron_sdk.types import ADAPTER_NAME_PATTERN, MODEL_ADAPTER_PATTERN

# A 1 x 1 PNG, as base64 and as a data URL: image items the schema allows (a text model
# answers them 422; an image model, 200).
_PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSu"
          "QmCC")
FUZZ_IMAGES = (_PIXEL, f"data:image/png;base64,{_PIXEL}")
UNMEETABLE_DEADLINE_S = 1.0  # a timeout_s under this may honestly end in 504
ADMIN_TOKEN = "fuzz-admin-token"
PATTERNS = {POOL_NAME_RE.pattern: pattern_names("fuzz-", 8),
            MODEL_NAME_PATTERN: pattern_names("fuzz/m", 40),
            ADAPTER_NAME_PATTERN: pattern_names("fuzz-lora", 4),  # LoRA adapter names
            MODEL_ADAPTER_PATTERN: pattern_names("fuzz/m", 40),
            IMAGE_PATTERN: lambda rng: rng.choice(FUZZ_IMAGES)}  # image items: 1 x 1 PNGs
MAX_EXAMPLES = 20  # failures kept per server, each with its body
SLOWEST_KEPT = 5  # the slowest answers kept per server
ANSWERED = (200, 201)  # a valid request's answer (not a 202: that is no capacity yet)
_ERROR_CODES = {c.value for c in ErrorCode}


@dataclass
class Target:
    """A running server and what to send it."""

    name: str
    url: str
    routes: list[Route]
    operations: tuple[ApiOperation, ...]
    check: tuple[str, str, dict[str, Any]]  # a valid request: (method, path, JSON body)
    headers: dict[str, str] = field(default_factory=dict)  # for the check
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)  # must stay alive

    def components(self) -> dict[str, Any]:
        return openapi_document(self.operations, title="fuzz", version="0")["components"][
            "schemas"]

    def factory(self, seed: int) -> CaseFactory:
        return CaseFactory(self.name, seed, self.routes, self.components(), PATTERNS)


def inference_routes(encode: str = "minilm", score: str = "minilm", extract: str = "minilm",
                     embeddings: str = "minilm") -> list[Route]:
    return [Route("encode", "POST", f"/v1/encode/{encode}", "EncodeBody"),
            Route("score", "POST", f"/v1/score/{score}", "ScoreBody"),
            Route("extract", "POST", f"/v1/extract/{extract}", "ExtractBody"),
            Route("embeddings", "POST", "/v1/embeddings", "EmbeddingsBody",
                  choices={"model": [embeddings, embeddings, embeddings, "no-such-model"]})]


def pool_routes(bundle: str) -> list[Route]:
    return [Route("pools", "POST", "/v1/pools", "PoolCreateBody",
                  choices={"bundle": [bundle, bundle, "no-such-bundle"]}),
            Route("pool_renew", "POST", "/v1/pools/fuzz-1/renew", "PoolRenewBody")]


def config_routes(bundles: list[str], token: str = ADMIN_TOKEN) -> list[Route]:
    return [Route("config", "POST", "/v1/configs/models", "ModelConfigBody",
                  formats=(JSON, MSGPACK, YAML), headers={"Authorization": f"Bearer {token}"},
                  max_body_bytes=1 << 20,
                  choices={"bundles": [[b] for b in bundles] + [bundles, ["no-such-bundle"]],
                           "adapter": ["dense", "sparse", "auto", None]})]


# ---- the run ------------------------------------------------------------------------------
@dataclass
class ServerReport:
    name: str
    url: str
    bodies: int = 0
    wall_s: float = 0.0
    statuses: Counter[str] = field(default_factory=Counter)
    by_kind: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    by_route: defaultdict[str, Counter[str]] = field(
        default_factory=lambda: defaultdict(Counter))
    deadline_504: int = 0
    slowest: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    failures: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = True
    healthy_after: str = "not checked"  # "ok" or what failed

    @property
    def passed(self) -> bool:
        return self.failures == 0 and self.complete and self.healthy_after == "ok"

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "bodies": self.bodies, "wall_s": round(self.wall_s, 1),
                "statuses": dict(sorted(self.statuses.items())),
                "five_xx": sum(n for s, n in self.statuses.items() if s.startswith("5")),
                "deadline_504_allowed": self.deadline_504, "failures": self.failures,
                "complete": self.complete, "healthy_after": self.healthy_after,
                "passed": self.passed,
                "slowest": [{"seconds": round(t, 3), **case} for t, case in self.slowest],
                "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(self.by_kind.items())},
                "by_route": {k: dict(sorted(v.items()))
                             for k, v in sorted(self.by_route.items())},
                "examples": self.examples}

    def timed(self, seconds: float, case: FuzzCase, status: int) -> None:
        """Keep the slowest answers (a body that nearly hangs a server shows here)."""
        if len(self.slowest) < SLOWEST_KEPT or seconds > self.slowest[-1][0]:
            entry = {k: v for k, v in describe(case, limit=200).items() if k != "headers"}
            self.slowest = sorted([*self.slowest, (seconds, {**entry, "status": status})],
                                  key=lambda pair: -pair[0])[:SLOWEST_KEPT]

    def fail(self, case: FuzzCase, status: str, why: str, answer: bytes = b"") -> None:
        self.failures += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({**describe(case), "status": status, "why": why,
                                  "answer": answer[:500].decode("utf-8", "replace")})


def describe(case: FuzzCase, limit: int = 2048) -> dict[str, Any]:
    """A case as the report shows it: the body as text when it is UTF-8, else base64."""
    out: dict[str, Any] = {"index": case.index, "route": case.route, "kind": case.kind,
                           "note": case.note, "method": case.method, "path": case.path,
                           "headers": case.headers, "body_bytes": len(case.content)}
    try:
        out["body_text"] = case.content[:limit].decode("utf-8")
    except UnicodeDecodeError:
        out["body_base64"] = base64.b64encode(case.content[:limit]).decode()
    return out


def error_code(response: httpx.Response) -> tuple[Any, str | None]:
    """(``error.code`` of an error answer, None), or (None, what is wrong with its body).
    Heron's shape, and OpenAI's on /v1/embeddings (Heron's code, lowercased)."""
    fmt = wire.media_type(response.headers.get("content-type")) or wire.JSON
    try:
        code = wire.decode(response.content, fmt)["error"]["code"]
        if isinstance(code, str) and code.islower():  # OpenAI's shape
            code = code.upper()
    except Exception as exc:  # any shape at all may come back: each is a finding
        return None, f"the {response.status_code} answer is not an error body: {exc!r}"
    return code, None if code in _ERROR_CODES else f"unknown error code {code!r}"


def classify(report: ServerReport, case: FuzzCase, response: httpx.Response) -> None:
    status = response.status_code
    label = str(status)
    report.statuses[label] += 1
    report.by_kind[case.kind][label] += 1
    report.by_route[case.route][label] += 1
    if status >= 500:
        deadline = (status == 504 and case.timeout_s is not None
                    and case.timeout_s < UNMEETABLE_DEADLINE_S
                    and error_code(response)[0] == ErrorCode.DEADLINE_EXCEEDED)
        if deadline:
            report.deadline_504 += 1
        else:
            report.fail(case, label, "server error", response.content)
        return
    if status >= 400:
        problem = error_code(response)[1]
        if problem is not None:
            report.fail(case, label, problem, response.content)


async def fuzz_async(target: Target, *, bodies: int, seed: int, concurrency: int,
                     time_limit_s: float, request_timeout_s: float) -> ServerReport:
    factory = target.factory(seed)
    report = ServerReport(target.name, target.url)
    indices = iter(range(bodies))
    started = time.monotonic()
    stop_at = started + time_limit_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=target.url, timeout=request_timeout_s,
                                 limits=limits) as client:

        async def sender() -> None:
            for index in indices:  # one iterator shared: each index is sent once
                if time.monotonic() > stop_at:
                    report.complete = False
                    return
                case = factory.case(index)
                report.bodies += 1
                sent = time.monotonic()
                try:
                    response = await client.request(case.method, case.path,
                                                    content=case.content, headers=case.headers)
                    report.timed(time.monotonic() - sent, case, response.status_code)
                except httpx.TimeoutException:
                    report.statuses["no answer"] += 1
                    report.fail(case, "no answer", f"no answer within {request_timeout_s} s")
                    continue
                except httpx.HTTPError as exc:
                    report.statuses["connection error"] += 1
                    report.fail(case, "connection error", repr(exc))
                    continue
                classify(report, case, response)

        await asyncio.gather(*(sender() for _ in range(concurrency)))
    report.wall_s = time.monotonic() - started
    report.healthy_after = health_after(target)
    return report


def fuzz_server(target: Target, *, bodies: int = 10_000, seed: int = 0, concurrency: int = 8,
                time_limit_s: float = 1800.0, request_timeout_s: float = 60.0) -> ServerReport:
    """Send ``bodies`` cases to ``target``; the report says what came back."""
    return asyncio.run(fuzz_async(target, bodies=bodies, seed=seed, concurrency=concurrency,
                                  time_limit_s=time_limit_s,
                                  request_timeout_s=request_timeout_s))


def health_after(target: Target) -> str:
    """"ok" when the processes live, /healthz is 200 and a valid request is answered."""
    for proc in target.procs:
        if proc.poll() is not None:
            return f"process {proc.pid} exited with {proc.returncode}"
    try:
        health = httpx.get(target.url + "/healthz", timeout=30)
        method, path, body = target.check
        answer = httpx.request(method, target.url + path, json=body, headers=target.headers,
                               timeout=60)
    except httpx.HTTPError as exc:
        return f"no answer: {exc!r}"
    if health.status_code != 200:
        return f"/healthz answered {health.status_code}"
    if answer.status_code not in ANSWERED:
        return f"{method} {path} answered {answer.status_code}: {answer.text[:200]}"
    return "ok"


def check_document(target: Target) -> None:
    """The document the server serves is the one the bodies are drawn from."""
    served = httpx.get(target.url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    if served != json.loads(json.dumps(target.components())):
        raise SystemExit(f"{target.name}: /openapi.json differs from the code's document")


# ---- the servers ----------------------------------------------------------------------------
class Child:
    """A child process with its log in ``log_dir``, stopped by its PID."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              "HF_HUB_OFFLINE": "1", **(env or {})})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def wait_for(url: str, children: list[Child], timeout_s: float = 300.0,
             check: tuple[str, str, dict[str, Any]] | None = None,
             headers: dict[str, str] | None = None) -> None:
    """Until /readyz is 200 (and ``check`` answers 2xx); a child that exits fails it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in children:
            if child.proc.poll() is not None:
                raise SystemExit(f"{child.log_path.name} exited:\n"
                                 f"{child.log_path.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/readyz", timeout=2).status_code == 200 and (
                    check is None or httpx.request(check[0], url + check[1], json=check[2],
                                                   headers=headers, timeout=30
                                                   ).status_code in ANSWERED):
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout_s:.0f} s")


def nats_server(work: Path) -> tuple[Child, str]:
    binary = Path(sys.executable).with_name("nats-server")
    port = free_port()
    store = work / f"nats-{port}"
    store.mkdir(parents=True)
    child = Child(f"nats-{port}", [str(binary), "-a", HOST, "-p", str(port), "-js", "-sd",
                                   str(store)], work)
    return child, f"nats://{HOST}:{port}"


ENCODE_CHECK = ("POST", "/v1/encode/minilm", {"items": ["a heron in the marsh"]})


@contextlib.contextmanager
def started(name: str, work: Path) -> Iterator[Target]:
    """The server ``name`` (serve, gateway, config), ready, and stopped on exit."""
    children: list[Child] = []
    try:
        if name == "serve":
            port = free_port()
            children.append(Child("serve", [*heron_command(), "serve", "--host", HOST, "--port",
                                            str(port), "--bundle", "default", "--workers", "1",
                                            "--log-level", "warning"], work))
            target = Target(name, f"http://{HOST}:{port}", inference_routes(),
                            INFERENCE_OPERATIONS, ENCODE_CHECK)
        elif name == "gateway":
            nats, url = nats_server(work)
            children.append(nats)
            port, worker_port = free_port(), free_port()
            children.append(Child("worker", [
                *heron_command(), "worker", "--nats", url, "--pool", "fuzz", "--bundle",
                "default", "--host", HOST, "--port", str(worker_port), "--worker-id",
                "fuzz-worker", "--log-level", "warning"], work))
            children.append(Child("gateway", [
                *heron_command(), "gateway", "--nats", url, "--pool", "default=fuzz",
                "--host", HOST, "--port", str(port), "--log-level", "warning"], work))
            target = Target(name, f"http://{HOST}:{port}",
                            inference_routes() + pool_routes("default"),
                            (*INFERENCE_OPERATIONS, *GATEWAY_OPERATIONS), ENCODE_CHECK)
        elif name == "config":
            nats, url = nats_server(work)
            children.append(nats)
            bundles = write_config_bundles(work / "config-bundles")
            port = free_port()
            children.append(Child("config", [
                *heron_command(), "config", "--nats", url, "--store", str(work / "store"),
                "--bundles-dir", str(bundles), "--host", HOST, "--port", str(port),
                "--log-level", "warning"], work, env={"HERON_ADMIN_TOKEN": ADMIN_TOKEN}))
            target = Target(name, f"http://{HOST}:{port}", config_routes(["alpha", "beta"]),
                            CONFIG_OPERATIONS, CONFIG_CHECK,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        else:
            raise SystemExit(f"no server {name!r}: serve, gateway or config")
        target.procs = [c.proc for c in children]
        wait_for(target.url, children, check=target.check, headers=target.headers)
        yield target
    finally:
        for child in reversed(children):
            child.stop()


CONFIG_CHECK = ("POST", "/v1/configs/models",
                {"id": "fuzz/check", "adapter": "dense", "source": {"hub": "fuzz/check"},
                 "bundles": ["alpha"]})


def write_config_bundles(root: Path) -> Path:
    """Two bundles (alpha: dense and sparse; beta: dense) of one hub model each: the
    config service loads no weights."""
    (root / "models").mkdir(parents=True)
    for bundle, adapters in (("alpha", ["dense", "sparse"]), ("beta", ["dense"])):
        (root / "models" / f"{bundle}.yaml").write_text(json.dumps(
            {"id": f"base/{bundle}", "adapter": "dense", "source": {"hub": f"base/{bundle}"}}))
        (root / f"{bundle}.yaml").write_text(json.dumps(
            {"name": bundle, "adapters": adapters, "models": [f"{bundle}.yaml"]}))
    return root


# ---- the command ----------------------------------------------------------------------------
def show_case(spec: str, seed: int) -> None:
    name, _, index = spec.partition(":")
    routes = {"serve": (inference_routes(), INFERENCE_OPERATIONS),
              "gateway": (inference_routes() + pool_routes("default"),
                          (*INFERENCE_OPERATIONS, *GATEWAY_OPERATIONS)),
              "config": (config_routes(["alpha", "beta"]), CONFIG_OPERATIONS)}[name]
    case = Target(name, "", *routes, ENCODE_CHECK).factory(seed).case(int(index))
    print(json.dumps(describe(case, limit=1 << 20), indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bodies", type=int, default=10_000, help="per server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", default="serve,gateway,config")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="per server")
    parser.add_argument("--request-timeout-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--show-case", metavar="SERVER:INDEX",
                        help="print one case (its headers and body) and exit")
    args = parser.parse_args(argv)
    if args.show_case:
        show_case(args.show_case, args.seed)
        return 0
    result: dict[str, Any] = {"benchmark": "fuzz", "seed": args.seed,
                              "bodies_per_server": args.bodies,
                              "concurrency": args.concurrency, "cpu_count": os.cpu_count(),
                              # other processes on the machine move the wall times
                              "load_average_start": os.getloadavg()[0], "servers": {}}
    started_at = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="heron-fuzz-"))
    for name in args.servers.split(","):
        print(f"[fuzz] starting {name} (logs in {work})", file=sys.stderr, flush=True)
        with started(name, work) as target:
            check_document(target)
            report = fuzz_server(target, bodies=args.bodies, seed=args.seed,
                                 concurrency=args.concurrency, time_limit_s=args.time_limit_s,
                                 request_timeout_s=args.request_timeout_s)
        result["servers"][name] = report.to_json()
        print(f"[fuzz] {name}: {report.bodies} bodies in {report.wall_s:.0f} s, "
              f"{dict(sorted(report.statuses.items()))}, failures {report.failures}, "
              f"healthy after: {report.healthy_after}", file=sys.stderr, flush=True)
    result["wall_s"] = round(time.monotonic() - started_at, 1)
    result["load_average_end"] = os.getloadavg()[0]
    result["passed"] = all(s["passed"] for s in result["servers"].values())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fuzz.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "servers"} | {
        "servers": {n: {k: s[k] for k in ("bodies", "wall_s", "statuses", "failures",
                                          "healthy_after")}
                    for n, s in result["servers"].items()}}, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
