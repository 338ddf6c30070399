"""Summary of a `device_run.sh shards` stage: per arch tag and test file, how many GPU tests
passed, failed, errored or were skipped, and how many were dealt to a shard but never reported
(the shard was cut off by its timeout). Reads the shards' `pytest -v` logs, which survive a
kill, unlike the JUnit files pytest writes at exit.

    python scripts/shard_summary.py DETAIL_DIR
"""
from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

RESULT = re.compile(r"^(tests/\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: |$)")
SHARD_LOG = re.compile(r"^(?P<tag>\w+)_shard(?P<n>\d+)\.log$")


def read_results(log: Path) -> dict:
    """Test id -> outcome as `pytest -v` printed it (the last word wins: a test that passed its
    call and errored in teardown prints twice)."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        m = RESULT.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def summarize(detail: Path) -> str:
    ids_file = detail / "gpu_test_ids.txt"
    dealt = [line.strip() for line in ids_file.read_text().splitlines() if "::" in line]
    by_tag: dict = collections.defaultdict(dict)
    for log in sorted(detail.iterdir()):
        m = SHARD_LOG.match(log.name)
        if m:
            by_tag[m.group("tag")].update(read_results(log))
    lines = []
    for tag, results in sorted(by_tag.items()):
        counts: dict = collections.defaultdict(collections.Counter)
        for test_id in dealt:
            counts[test_id.split("::")[0]][results.get(test_id, "NOT RUN")] += 1
        total = collections.Counter()
        for file, c in sorted(counts.items()):
            total.update(c)
            lines.append(f"{tag:7s} {Path(file).stem:28s} " + ", ".join(
                f"{n} {k.lower()}" for k, n in sorted(c.items())))
        lines.append(f"{tag:7s} {'ALL':28s} " + ", ".join(
            f"{n} {k.lower()}" for k, n in sorted(total.items())))
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1])))
