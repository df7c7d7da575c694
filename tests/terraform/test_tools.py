"""terraform fmt and checkov over terraform/ (each skipped where its tool is missing;
`make test` installs checkov in .venv-checkov through the checkov-venv target)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from .conftest import ROOT, TF_FILES

CHECKOV = ROOT.parent / ".venv-checkov" / "bin" / "checkov"


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform is not installed")
def test_terraform_fmt():
    proc = subprocess.run(
        ["terraform", "fmt", "-check", "-recursive", "-diff", str(ROOT)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, f"terraform fmt would change:\n{proc.stdout}{proc.stderr}"


@pytest.fixture(scope="module")
def checkov_report():
    if not CHECKOV.exists():
        pytest.skip(f"{CHECKOV} is missing (make checkov-venv)")
    proc = subprocess.run(
        [str(CHECKOV), "--directory", str(ROOT), "--framework", "terraform",
         "--output", "json", "--skip-download"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
    )
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    return report if isinstance(report, dict) else report[0]


def test_checkov_finds_nothing_unexplained(checkov_report):
    """No failed check at all: offline, checkov reports no severities, so every finding,
    whatever its severity, is either fixed or skipped with a reason in the .tf file."""
    summary = checkov_report["summary"]
    assert summary["parsing_errors"] == 0
    assert summary["resource_count"] >= 30, summary  # it did scan modules and examples
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
        for c in checkov_report["results"]["failed_checks"]
    ]
    assert not failed, "\n".join(failed)


def test_checkov_skips_are_explained(checkov_report):
    skipped = checkov_report["results"]["skipped_checks"]
    for check in skipped:
        reason = check["check_result"].get("suppress_comment", "")
        assert len(reason) >= 20 and reason != "No comment provided", check["check_id"]
    # Every skip comment in the sources is one checkov applied (no stale or mistyped id).
    in_sources = {
        m for path in TF_FILES
        for m in re.findall(r"#checkov:skip=(CKV\w+):", path.read_text())
    }
    assert in_sources == {c["check_id"] for c in skipped}


def test_skips_are_documented(checkov_report):
    """The docs list every check skipped in terraform/, so a reader sees what is left."""
    docs = ROOT / "README.md"
    deploy = ROOT.parent / "docs" / "deploy.md"
    text = docs.read_text() + (deploy.read_text() if deploy.exists() else "")
    for check in checkov_report["results"]["skipped_checks"]:
        assert check["check_id"] in text, f"{check['check_id']} is not documented"
