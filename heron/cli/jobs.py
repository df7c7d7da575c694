"""``heron jobs list | show ID [--wait] | cancel ID``: bulk jobs from a terminal (the SDK's
``client.jobs``). ``list`` prints a table; ``show`` and ``cancel`` print the job's JSON (so it
pipes into ``jq``); ``show --wait`` follows it with a progress bar until it finishes. An
error prints its code and exits 1."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from heron.cli.client import run_client_command
from heron_sdk.client import Client, default_url
from heron_sdk.jobs import Job


def _row(info: dict[str, Any]) -> str:
    total = info.get("rows_total")
    done = f"{info.get('rows_done', 0)}/{'?' if total is None else total}"
    rate = info.get("rows_per_s")
    eta = info.get("eta_s")
    return (f"{info['id']:<26} {info['state']:<10} {done:>15} {info.get('rows_failed', 0):>7} "
            f"{'-' if rate is None else f'{rate:g}':>9} {'-' if eta is None else f'{eta:g}':>7} "
            f"{info.get('output_uri') or ''}")


def _list(client: Client, args: argparse.Namespace) -> Any:
    jobs = client.jobs.list()
    if args.json:
        return {"object": "list", "data": [job.info for job in jobs]}
    print(f"{'ID':<26} {'STATE':<10} {'ROWS':>15} {'FAILED':>7} {'ROWS/S':>9} {'ETA S':>7} OUTPUT")
    for job in jobs:
        print(_row(job.info))
    return None


def _show(client: Client, args: argparse.Namespace) -> Any:
    job: Job = client.jobs.get(args.job_id)
    if args.wait:
        bar = sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None
        job.wait(progress=bar, poll_s=args.poll)
    return job.info


def _cancel(client: Client, args: argparse.Namespace) -> Any:
    return client.jobs.cancel(args.job_id).info


def _run(args: argparse.Namespace) -> int:
    def command(client: Client, args: argparse.Namespace) -> Any:
        out = args.jobs_command(client, args)
        if out is not None:  # printed by run_client_command
            return out
        raise _Printed

    try:
        return run_client_command(args, command)
    except _Printed:
        return 0


class _Printed(Exception):
    """The command printed its own output (a table), not JSON."""


def add_jobs_command(sub: argparse._SubParsersAction) -> None:
    jobs = sub.add_parser("jobs", help="bulk jobs on a cluster gateway: heron jobs list | "
                                       "show ID [--wait] | cancel ID")
    jobs.add_argument("--url", default=default_url(),
                      help="gateway URL (default: HERON_URL or %(default)s)")
    jobs.add_argument("--timeout", type=float, default=60.0, help="seconds for each call")
    jobs.set_defaults(func=_run, pool=os.environ.get("HERON_POOL_NAME"),
                      provision_timeout=300.0)
    actions = jobs.add_subparsers(dest="jobs_action", required=True)
    listing = actions.add_parser("list", help="every job, newest first")
    listing.add_argument("--json", action="store_true", help="the API's JSON, not a table")
    listing.set_defaults(jobs_command=_list)
    show = actions.add_parser("show", help="one job's state and progress (JSON)")
    show.add_argument("job_id")
    show.add_argument("--wait", action="store_true",
                      help="follow it until it finishes (a progress bar on a terminal); "
                           "exit 1 if it failed")
    show.add_argument("--poll", type=float, default=1.0, help="seconds between reads")
    show.set_defaults(jobs_command=_show)
    cancel = actions.add_parser("cancel", help="cancel a job (a finished one is left as is)")
    cancel.add_argument("job_id")
    cancel.set_defaults(jobs_command=_cancel)
