"""Run the zoo matrix (test/zoo_matrix.py) case by case and print a table: case, status,
copy-engine share (lowest over the ranks), wall time, what the case exercises beyond an
even model (``Case.exercises``), and the first failure line.

    cd <repo> && PYTHONPATH=$PWD python test/zoo_matrix_report.py            # every case
    PYTHONPATH=$PWD python test/zoo_matrix_report.py -k moe -k w4            # ids with all of these
    PYTHONPATH=$PWD python test/zoo_matrix_report.py --default --out DIR     # the CI subset
    PYTHONPATH=$PWD python test/zoo_matrix_report.py ID [ID ...]             # these, in this order

Each case runs in a subprocess of its own (this script with ``--case ID``), under the
case's own timeout (the harness dumps every rank's stacks at it and kills the ranks), plus
a margin for this script. Status:

- pass: outputs / losses bit-identical to the plain compiled run on every rank and a
  copy-engine share >= 0.99;
- fail: a rank raised, or a check failed (the reason is printed);
- hang: the harness timed out and the ranks' stacks show them in a collective or in a
  bind exchange;
- timeout: it timed out elsewhere (slowness, not a wait on a peer).

``--out DIR`` keeps each case's log (``<id>.log``: stdout and stderr, stacks included) and
its result (``<id>.json``), and ``report.json`` with every row.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zoo_matrix as M  # noqa: E402

MARGIN_S = 90  # process start, imports, the harness's kill and stack dumps
# The innermost frames of a rank waiting on its peers (a hang, not slowness): a collective,
# a wait on one, the store (bind exchanges), a barrier.
WAITING = re.compile(r"distributed_c10d|_functional_collectives|_c10d_functional|wait_tensor|"
                     r"torch_ce/runtime/agreement|torch_ce/_net|store|barrier|gloo")
INNERMOST = 4  # frames per rank that decide


def run_one(case_id: str, json_path: str, cache: str) -> int:
    """Child mode: run one case on its ranks, write its result, exit 0 if it passes."""
    import pytest

    from mp_harness import run_ranks, seed_base

    c = M.CASES[case_id]
    seed = seed_base()
    out = dict(case=case_id, seed=seed)
    t0 = time.monotonic()
    try:
        res = run_ranks(M.run_case, c.world, vars(c), seed, cache, timeout=c.timeout,
                        env={"TORCH_CE_BIND_ARRIVAL_TIMEOUT_S": str(c.timeout // 2)})
        bad = M.failures(c, res) + M.shape_checks(c, res[0]["placements"])
        shares = [r["coverage"]["total"]["share"] for r in res]
        out.update(status="pass" if not bad else "fail", problems=bad,
                   share=min((s for s in shares if s is not None), default=None),
                   coverage=[r["coverage"] for r in res], table_rank0=res[0]["table"])
    except pytest.fail.Exception as e:  # a rank raised, or the harness timed out
        msg = str(e)
        out.update(status="timed_out" if "timed out (hang?)" in msg else "fail", problems=[msg[-4000:]])
    out["wall_s"] = round(time.monotonic() - t0, 1)
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0 if out["status"] == "pass" else 1


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
# A generated graph's line that waits on peers (the rank's innermost generated-code frame).
_COLLECTIVE_LINE = re.compile(r"_c10d_functional\.|torch\.ops\.magi\.|wait_tensor")


def waits(log: str) -> list[str] | None:
    """Per rank the harness dumped: what it waits in ("rank 0: <the generated line>"), or
    None if some rank is not waiting on its peers (compiling, computing: slowness).

    A rank waits when one of its innermost frames is in torch.distributed, the store or
    a bind exchange, or when its innermost frame in Inductor's generated code is a
    collective or a wait (the line is read from the cache file, which outlives the run)."""
    out = []
    for b in log.split("still running: its stacks ----")[1:]:
        rank = re.search(r"rank (\d+) \(pid", log[:log.find(b)].rsplit("----", 2)[-2] + "(pid")
        frames = _FRAME.findall(b)
        where = next((f"{path}:{line}" for path, line in frames[:INNERMOST] if WAITING.search(path)), None)
        if where is None:
            for path, line in frames:
                if "/inductor_rank" in path or "torchinductor" in path:
                    try:
                        lines = open(path).read().splitlines()[:int(line)]
                    except OSError:
                        lines = [""]
                    text = lines[-1].strip()
                    if _COLLECTIVE_LINE.search(text):
                        where = text
                        m = re.search(r"wait_tensor\.default\((buf\d+)\)", text)
                        made = [ln.strip() for ln in lines if m and ln.strip().startswith(f"{m.group(1)} = ")]
                        if made:  # name the collective it waits for
                            where = f"wait({made[-1]})"
                    break
        if where is None:
            return None
        out.append(f"rank {rank.group(1) if rank else '?'}: {where}")
    return out or None


def _classify(result: dict | None, log: str, rc: int | None) -> str:
    """pass / fail from the child's result; a harness timeout is a hang when every rank
    still running waits on its peers (``waits``), else a timeout."""
    if result is None:
        return "timeout" if rc is None else "fail"
    if result["status"] != "timed_out":
        return result["status"]
    return "hang" if waits(log) else "timeout"


def _first_problem(result: dict | None, log: str) -> str:
    w = waits(log) if result and result.get("status") == "timed_out" else None
    if w:  # the ranks' waits, deduplicated
        return "; ".join(dict.fromkeys(x.split(": ", 1)[1] for x in w)) + f" ({len(w)} ranks)"
    if result and result.get("problems"):
        text = result["problems"][0]
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        # A rank's traceback: its last line is the error.
        errs = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Failed)\b", ln)]
        return (errs[-1] if errs else lines[0])[:160]
    tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or [""]
    return tail[0][:160]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ids", nargs="*", help="case ids to run, in this order (default: every case)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("-k", action="append", default=[], help="run only ids containing this (repeatable: all)")
    ap.add_argument("--default", action="store_true", help="only the default CI subset")
    ap.add_argument("--list", action="store_true", help="list the case ids and exit")
    ap.add_argument("--out", help="keep logs and results here")
    a = ap.parse_args(argv)
    if a.case:
        return run_one(a.case, a.json, a.cache)
    unknown = sorted(set(a.ids) - set(M.CASES))
    if unknown:
        ap.error(f"unknown case id(s): {', '.join(unknown)} (--list shows them)")
    ids = list(a.ids) or (list(M.DEFAULT) if a.default else list(M.CASES))
    ids = [i for i in ids if all(k in i for k in a.k)]
    if a.list:
        for i in ids:
            print(i, ",".join(sorted(M.CASES[i].exercises)))
        return 0
    out = a.out or tempfile.mkdtemp(prefix="zoo_matrix_report_")
    os.makedirs(out, exist_ok=True)
    cache = os.path.join(out, "inductor")  # per rank, shared by the cases (M.run_case)
    rows = []
    head = f"{'case':<44} {'status':<8} {'CE share':>9} {'wall s':>7}  {'exercises':<24} first problem"
    print(head, flush=True)
    for cid in ids:
        c = M.CASES[cid]
        jpath, lpath = os.path.join(out, f"{cid}.json"), os.path.join(out, f"{cid}.log")
        if os.path.exists(jpath):
            os.remove(jpath)
        t0 = time.monotonic()
        rc = None
        with open(lpath, "w") as log:
            # A session of its own: on our timeout the child and its ranks go together.
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--case", cid, "--json", jpath,
                                  "--cache", cache],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=c.timeout + MARGIN_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        wall = time.monotonic() - t0
        result = json.load(open(jpath)) if os.path.exists(jpath) else None
        text = open(lpath, errors="replace").read()
        status = _classify(result, text, rc)
        share = result.get("share") if result else None
        row = dict(case=cid, status=status, share=share, wall_s=round(wall, 1), exercises=sorted(c.exercises),
                   problem="" if status == "pass" else _first_problem(result, text))
        rows.append(row)
        sh = "-" if share is None else f"{100 * share:.1f}%"
        print(f"{cid:<44} {status:<8} {sh:>9} {wall:>7.0f}  {','.join(row['exercises']) or '-':<24} {row['problem']}",
              flush=True)
        with open(os.path.join(out, "report.json"), "w") as f:  # after every case: a cut run keeps its rows
            json.dump(rows, f, indent=1)
    n = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "hang", "timeout")}
    print(f"\n{len(rows)} case(s): " + ", ".join(f"{v} {k}" for k, v in n.items()) + f"; logs in {out}")
    return 0 if n["pass"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
