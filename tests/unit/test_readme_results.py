"""README numbers come from runs (issue #17, item 12).

Convention (docs/results/README.md): a result block in README.md is a fenced block right after a line
`<!-- result: docs/results/NAME.txt -->`. NAME.txt is what a run printed, saved by the run itself
(`--results-dir docs/results`, benchmarks.common.save_results): its first line is the command that
made it, the rest the printed text. The block must be a verbatim run of whole lines of that text; if
its first line is `$ COMMAND`, COMMAND must be the .txt's first line. NAME.json (the run's summary
numbers) must sit beside it, parse, name the same command, stay small, and not come from a failed run.
An untagged fenced block with result-looking numbers and no marker is refused: every number block in
the README has a run behind it.

How each check was seen to fail (each broken once by hand, then restored):
- verbatim: one digit of a marked block changed (test_edited_number_is_caught, and the same on the real
  README in test_real_readme_edit_is_caught); with `_contains_run` temporarily returning True, both
  tests failed;
- unmarked: the marker line removed (test_unmarked_numbers_are_refused); with the unmarked check
  commented out in readme_problems, it failed;
- command, json missing / unparsable / too large / failed run, a path outside docs/results, a block with
  only the command, a stray marker: one mutation each in test_each_broken_link_is_caught; with that check
  switched off (`if False:`), its case failed;
- the producers: with publish() not passing results_dir to save_results, test_transfer_saves_what_it_printed
  and test_tiers_saves_its_run failed (no .txt).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvconnectors.benchmarks import common

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MARKER = re.compile(r"^<!--\s*result:\s*(\S+)\s*-->\s*$")
FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)\s*$")
OUTPUT_LANGS = {"", "text", "console", "output"}  # a block tagged with a code language is code, not a result
# a decimal, or a count with a unit: what a benchmark, soak or demo prints
RESULT_LOOKING = re.compile(r"\d\.\d|\d\s?(ms|MiB|MB|GB/s|Gb/s|KiB|req/s|%)(?![\w/])")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    lines: list[str]
    marker: str | None  # the path named by the marker line right before the fence
    heading: str  # the last "## " heading above it


def fenced_blocks(text: str) -> tuple[list[Block], list[str]]:
    """The README's fenced blocks, and problems found while reading (a marker with no block after it,
    an unclosed fence)."""
    blocks: list[Block] = []
    problems: list[str] = []
    lines = text.splitlines()
    heading, marker, i = "", None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            heading = line[3:].strip()
        m = FENCE.match(line)
        if m:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == m.group(1)), None)
            if end is None:
                problems.append(f"line {i + 1}: fenced block never closed")
                break
            blocks.append(Block(i + 1, m.group(2), lines[i + 1:end], marker, heading))
            marker, i = None, end + 1
            continue
        if marker is not None:
            problems.append(f"marker for {marker} is not directly followed by a fenced block")
            marker = None
        mk = MARKER.match(line)
        if mk:
            marker = mk.group(1)
        i += 1
    if marker is not None:
        problems.append(f"marker for {marker} is not directly followed by a fenced block")
    return blocks, problems


def _contains_run(haystack: list[str], needle: list[str]) -> bool:
    """Whether `needle` is a contiguous run of whole lines of `haystack` (trailing blanks ignored)."""
    h = [x.rstrip() for x in haystack]
    n = [x.rstrip() for x in needle]
    return any(h[k:k + len(n)] == n for k in range(len(h) - len(n) + 1))


def _json_problems(where: str, path: Path, command: str) -> list[str]:
    if not path.is_file():
        return [f"{where}: {path.name} missing beside the .txt"]
    size = path.stat().st_size
    if size > common.RESULT_JSON_MAX_BYTES:
        return [f"{where}: {path.name} is {size:,} bytes (> {common.RESULT_JSON_MAX_BYTES:,}; summaries only)"]
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return [f"{where}: {path.name} does not parse: {exc}"]
    if not isinstance(record, dict) or "result" not in record:
        return [f"{where}: {path.name} is not a saved run (no 'result')"]
    problems = []
    if record.get("command") != command:
        problems.append(f"{where}: {path.name} names command {record.get('command')!r}, the .txt {command!r}")
    rc = record["result"].get("returncode") if isinstance(record["result"], dict) else None
    if rc not in (None, 0):
        problems.append(f"{where}: quotes a failed run (exit status {rc})")
    return problems


def _block_problems(block: Block, root: Path) -> list[str]:
    where = f"README line {block.line} ({block.marker})"
    rel = Path(block.marker or "")
    if rel.suffix != ".txt" or rel.parts[:2] != ("docs", "results") or ".." in rel.parts:
        return [f"{where}: a result must be a docs/results/NAME.txt file"]
    txt = root / rel
    if not txt.is_file():
        return [f"{where}: {rel} does not exist"]
    saved = txt.read_text().splitlines()
    if not saved:
        return [f"{where}: {rel} is empty"]
    command, body = saved[0], saved[1:]
    shown = block.lines
    problems = []
    if shown and shown[0].startswith("$ "):
        if shown[0][2:].strip() != command.strip():
            problems.append(f"{where}: README shows command {shown[0][2:]!r}, the run was {command!r}")
        shown = shown[1:]
    if not any(x.strip() for x in shown):
        problems.append(f"{where}: the block quotes no output")
    elif not _contains_run(body, shown):
        problems.append(f"{where}: the block is not a verbatim run of lines of {rel}")
    return problems + _json_problems(where, txt.with_suffix(".json"), command)


def readme_problems(text: str, root: Path = REPO) -> list[str]:
    """Every way `text` (a README) breaks the convention, with result files looked up under `root`."""
    blocks, problems = fenced_blocks(text)
    for b in blocks:
        if b.marker is not None:
            problems += _block_problems(b, root)
        elif b.lang in OUTPUT_LANGS and any(RESULT_LOOKING.search(x) for x in b.lines):
            problems.append(f"README line {b.line} (under '{b.heading}'): numbers with no "
                            "<!-- result: docs/results/NAME.txt --> marker, so no saved run behind them")
    return problems


# ============================================================================== the README itself
def test_readme_numbers_come_from_saved_runs():
    problems = readme_problems(README.read_text())
    assert not problems, "\n".join(problems)


def test_real_readme_edit_is_caught():
    """Negative control on the real README: change one digit inside each marked block in turn."""
    text = README.read_text()
    blocks, _ = fenced_blocks(text)
    marked = [b for b in blocks if b.marker and any(re.search(r"\d", x) for x in b.lines)]
    assert marked, "the README marks no result block"
    lines = text.splitlines()
    baseline = len(readme_problems(text))
    for b in marked:
        k = next(j for j, x in enumerate(b.lines) if re.search(r"\d", x) and not x.startswith("$ "))
        at = b.line + k  # 0-based index of that block line in `lines`
        edited = list(lines)
        edited[at] = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), edited[at], count=1)
        assert len(readme_problems("\n".join(edited) + "\n")) > baseline, f"edit of README line {at + 1} unseen"


# ============================================================================== the checker, on a README it is given
TABLE = "path    GB/s med\n------  --------\nmemcpy     11.32\ntcp         3.33"
CMD = "kvconnectors bench transfer --preset tiny --results-dir docs/results"


def _fixture(root: Path) -> str:
    """A results folder written by the real writer, and a README that quotes it correctly."""
    common.save_results(root / "docs" / "results", "transfer", f"transfer: preset tiny\n\n{TABLE}\n", {"x": 1.5},
                        command=CMD)
    block = "\n".join(f"{x}" for x in TABLE.splitlines()[:3])
    return f"# t\n\n## Benchmarks\n\n<!-- result: docs/results/transfer.txt -->\n```\n$ {CMD}\n{block}\n```\n"


def test_a_correct_quote_passes(tmp_path):
    readme = _fixture(tmp_path)
    assert readme_problems(readme, tmp_path) == []
    saved = (tmp_path / "docs/results/transfer.txt").read_text().splitlines()
    assert saved[0] == CMD and saved[1] == "transfer: preset tiny"


def test_edited_number_is_caught(tmp_path):
    readme = _fixture(tmp_path).replace("11.32", "11.33")
    assert any("not a verbatim run" in p for p in readme_problems(readme, tmp_path))


def test_unmarked_numbers_are_refused(tmp_path):
    readme = _fixture(tmp_path).replace("<!-- result: docs/results/transfer.txt -->\n", "")
    problems = readme_problems(readme, tmp_path)
    assert len(problems) == 1 and "no <!-- result" in problems[0] and "'Benchmarks'" in problems[0]
    code = "```bash\nkvconnectors bench transfer --iters 6 --tokens 2048   # 1.5 GB\n```\n"
    assert readme_problems(code, tmp_path) == []  # a code block is not a result


@pytest.mark.parametrize("case", ["command", "no json", "bad json", "big json", "failed run", "missing txt",
                                  "outside docs/results", "stray marker", "only the command", "partial line"])
def test_each_broken_link_is_caught(tmp_path, case):
    readme = _fixture(tmp_path)
    results = tmp_path / "docs" / "results"
    js = results / "transfer.json"
    if case == "command":
        readme = readme.replace("--preset tiny", "--preset 8b", 1)
    elif case == "no json":
        js.unlink()
    elif case == "bad json":
        js.write_text("{")
    elif case == "big json":
        js.write_text(json.dumps({"command": CMD, "result": {"pad": "x" * common.RESULT_JSON_MAX_BYTES}}))
    elif case == "failed run":
        js.write_text(json.dumps({"command": CMD, "result": {"returncode": 1}}))
    elif case == "missing txt":
        (results / "transfer.txt").unlink()
    elif case == "outside docs/results":  # a real run, but not where the committed results live
        for f in ("transfer.txt", "transfer.json"):
            (tmp_path / f).write_text((results / f).read_text())
        readme = readme.replace("docs/results/transfer.txt", "transfer.txt")
    elif case == "stray marker":  # a marker whose block was deleted: nothing is checked against it
        readme += "\n<!-- result: docs/results/transfer.txt -->\n\nprose\n"
    elif case == "only the command":
        readme = re.sub(r"(\$ [^\n]*\n).*?```", r"\1```", readme, flags=re.S)
    elif case == "partial line":  # a fragment of a line is not the line
        readme = readme.replace("memcpy     11.32", "memcpy     11.3")
    assert readme_problems(readme, tmp_path), case


# ============================================================================== the producers save what they print
def test_transfer_saves_what_it_printed(tmp_path, capsys, monkeypatch):
    from kvconnectors.cli import main

    argv = ["bench", "transfer", "--preset", "tiny", "--tokens", "32", "--iters", "1", "--paths", "memcpy,gather",
            "--out", str(tmp_path / "out"), "--no-progress", "--results-dir", str(tmp_path / "res")]
    monkeypatch.setattr(sys, "argv", ["/some/venv/bin/kvconnectors", *argv])
    assert main(argv) == 0
    printed = capsys.readouterr().out
    saved = (tmp_path / "res" / "transfer_tiny_32tok_b16.txt").read_text()
    command, _, body = saved.partition("\n")
    assert command == "kvconnectors " + " ".join(argv)
    assert body.rstrip("\n") == printed.rstrip("\n") and "memcpy" in body and "GB/s med" in body
    record = json.loads((tmp_path / "res" / "transfer_tiny_32tok_b16.json").read_text())
    assert record["command"] == command and record["result"]["benchmark"] == "transfer"
    assert record["result"]["paths"]["memcpy"]["gbps_median"] > 0 and "commit" in record["git"]


@pytest.mark.timeout(60)
def test_tiers_saves_its_run(tmp_path):
    from kvconnectors.benchmarks import tiers

    result = tiers.run_tiers(nbytes=1 << 20, preset="tiny", block_tokens=16, entry_tokens=64, rounds=1, warmup=0,
                             directory=str(tmp_path / "disk"), out=str(tmp_path / "out"), show_progress=False,
                             quiet=True, results_dir=str(tmp_path / "res"))
    body = (tmp_path / "res" / "tiers_tiny_1MiB.txt").read_text().split("\n", 1)[1]
    assert body.rstrip("\n") == tiers.render(result)
    assert json.loads((tmp_path / "res" / "tiers_tiny_1MiB.json").read_text())["result"]["benchmark"] == "tiers"


def test_every_benchmark_and_the_demo_take_results_dir():
    from kvconnectors.benchmarks import cli as bench_cli
    from kvconnectors.benchmarks import demo

    for name, (module_name, _) in bench_cli.BENCHMARKS.items():
        parser = argparse.ArgumentParser()
        __import__(module_name, fromlist=["add_arguments"]).add_arguments(parser)
        assert parser.parse_args(["--results-dir", "d"]).results_dir == "d", name
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert str(parser.parse_args(["--results-dir", "d"]).results_dir) == "d"


def test_proxy_report_saves_what_it_printed(tmp_path, capsys):
    from kvconnectors.benchmarks import proxy_overhead

    result = {"upstreams": "fake", **proxy_overhead.summarize([0.010 + i * 1e-4 for i in range(40)],
                                                               [0.0115 + i * 1e-4 for i in range(40)])}
    args = argparse.Namespace(out=tmp_path / "out", results_dir=tmp_path / "res")
    proxy_overhead._report(result, args, "proxy_overhead_fake")
    printed = capsys.readouterr().out
    body = (tmp_path / "res" / "proxy_overhead_fake.txt").read_text().split("\n", 1)[1]
    assert body.rstrip("\n") == printed.rstrip("\n") == proxy_overhead.render(result)
    saved = json.loads((tmp_path / "res" / "proxy_overhead_fake.json").read_text())["result"]
    assert saved["pairs_ms"]["by_hand"]["n"] == 40  # 40 raw samples kept as their summary
    assert saved["added_ms"]["p50"] == result["added_ms"]["p50"]
    assert (tmp_path / "out" / "proxy_overhead_fake.json").is_file()


def test_summary_numbers_drops_raw_samples():
    obj = {"times_s": [0.1] * 5, "pairs": list(range(1000)), "runs": [{"ttft_s": 1.0}] * 3,
           "rows": [{"a": 1}] * 20, "flag": [True] * 20}
    slim = common.summary_numbers(obj)
    assert slim["times_s"] == [0.1] * 5  # a handful of numbers is a summary already
    assert slim["pairs"] == {"n": 1000, "min": 0.0, "median": 499.5, "max": 999.0}
    assert slim["runs"].startswith("omitted")
    assert slim["rows"] == [{"a": 1}] * 20 and slim["flag"] == [True] * 20


def test_capture_saves_tagged_json_and_exit_status(tmp_path, capsys):
    code = "print('noise 1.5 ms'); print('SOAK {\"requests\": 3}'); import sys; sys.exit(%d)"
    argv = ["capture", "soak", "--keep", "^SOAK ", "--results-dir", str(tmp_path), "--", sys.executable, "-c"]
    assert common.main(argv + [code % 0]) == 0  # options after NAME are ours, everything after -- the command
    assert "noise 1.5 ms" in capsys.readouterr().out  # passed through, not saved
    lines = (tmp_path / "soak.txt").read_text().splitlines()
    assert lines[1:] == ['SOAK {"requests": 3}'] and lines[0].startswith(Path(sys.executable).name + " -c ")
    record = json.loads((tmp_path / "soak.json").read_text())
    assert record["result"]["tagged"] == {"SOAK": {"requests": 3}} and record["result"]["returncode"] == 0
    assert common.capture(tmp_path, "soak", [sys.executable, "-c", code % 3]) == 3
    assert json.loads((tmp_path / "soak.json").read_text())["result"]["returncode"] == 3


def test_command_line_is_what_a_reader_types(monkeypatch):
    assert common.command_line(["/x/.venv/bin/kvconnectors", "bench", "tiers", "--dir", "a b"]) == \
        "kvconnectors bench tiers --dir 'a b'"
    assert common.command_line([".venv/bin/kvconnectors", "demo"]) == "kvconnectors demo"
    assert common.command_line(["./dev", "demo"]) == "./dev demo"
    spec = argparse.Namespace(name="kvconnectors.benchmarks.layerwise")
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", spec, raising=False)
    assert common.command_line(["/w/benchmarks/layerwise.py", "--reps", "5"]) == \
        "python -m kvconnectors.benchmarks.layerwise --reps 5"
