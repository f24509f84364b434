"""The model owner's report.html on a tiny target, distilled once for the module (its curves measured with
a tiny report budget): opened in headless Chromium, which must render every section; its numbers equal
metrics.json's and the curve files'; no external URL; every figure captioned with its provenance."""

import json
import os
import shlex
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.owner_report import CAPTION_FIELDS, SECTIONS, bootstrap_ci, per_prompt, pooled_speedup, write_html_report

from helpers import TINY_BUDGET

# smaller than test_distill's: one checkpoint, no hybrid (its tree-budget fit); the report needs a promoted draft
DISTILL_BUDGET = [*TINY_BUDGET, "train.steps=2", "evaluate.hybrid=false"]
REPORT_BUDGET = ["report.bootstrap=200"]  # TINY_BUDGET's curves: K 1, 2; batch 1, 2; T 0, 1; 2 prompts
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def chromium():
    exe = shutil.which("chromium")
    if exe is None:
        if os.geteuid() != 0:
            pytest.skip("Debian's chromium is not installed and this user cannot install it (not root): "
                        "`sudo apt-get install chromium`, or run `make test` as root")
        pytest.fail("chromium is not installed: `make test` installs it (apt-get install -y chromium)")
    return exe


def _chromium(exe: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", *args],
                          capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def run(tiny_target, tmp_path_factory):
    """One tiny distill (report.html written at its end): the run directory."""
    runs = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        assert main(["distill", "--recipe", "recipes/code.yaml", f"target={tiny_target}", "dtype=float32",
                     f"runs_dir={runs}", "wandb.mode=disabled", *DISTILL_BUDGET, *REPORT_BUDGET]) == 0
    return (runs / "code" / "latest").resolve()


class Page(HTMLParser):
    """What the tests read from a page: section headings, numbers with their sources, figures with their
    captions' fields, and every src/href."""

    def __init__(self, text: str):
        super().__init__()
        self.h2, self.numbers, self.figures, self.links = [], [], [], []
        self._in_h2 = self._field = None
        self.text = ""  # every text node, joined
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.links += [v for k, v in attrs if k in ("src", "href") and v]
        if tag == "h2":
            self._in_h2 = ""
        if "data-value" in a:
            self.numbers.append(a)
        if tag == "figure":
            self.figures.append({"img": 0, "caption": {}})
        if tag == "img" and self.figures:
            self.figures[-1]["img"] += 1
        if a.get("data-field") and self.figures:
            self._field = a["data-field"]
            self.figures[-1]["caption"][self._field] = ""

    def handle_endtag(self, tag):
        if tag == "h2" and self._in_h2 is not None:
            self.h2.append(self._in_h2.strip())
            self._in_h2 = None
        if tag == "span":
            self._field = None

    def handle_data(self, data):
        self.text += data
        if self._in_h2 is not None:
            self._in_h2 += data
        if self._field:
            self.figures[-1]["caption"][self._field] += data


def _lookup(doc, key: str):
    for part in key.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


@pytest.fixture(scope="module")
def rendered(run, chromium, tmp_path_factory):
    """The distill's report.html as headless Chromium renders it: (its DOM, the screenshot's path)."""
    tmp = tmp_path_factory.mktemp("chromium")
    url = (run / "report.html").as_uri()
    dom = _chromium(chromium, tmp, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    png = tmp / "report.png"
    shot = _chromium(chromium, tmp, f"--screenshot={png}", "--window-size=1200,3000", url)
    assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
    return Page(dom.stdout), png


def test_report_renders_every_section(rendered):
    from PIL import Image

    page, png = rendered
    assert page.h2 == [title for _, title in SECTIONS]
    img = Image.open(png).convert("RGB")
    assert img.size == (1200, 3000)
    small = img.resize((120, 300))
    assert len(small.getcolors(maxcolors=1 << 16)) > 20  # text, tables and plots drawn, not a blank page
    assert len(page.figures) >= 6 and all(f["img"] == 1 for f in page.figures)


def test_numbers_equal_the_files_they_come_from(run, rendered):
    """Every number tagged with a file equals that file's value exactly; the summary's vLLM figures, the
    per-position acceptance, the n-gram baseline and every curve point are among them."""
    page, _ = rendered
    files = {}
    seen = set()
    for n in page.numbers:
        if "data-src" not in n:
            continue
        doc = files.setdefault(n["data-src"], json.loads((run / n["data-src"]).read_text()))
        assert json.loads(n["data-value"]) == _lookup(doc, n["data-key"]), (n["data-src"], n["data-key"])
        seen.add((n["data-src"], n["data-key"]))
    m = json.loads((run / "metrics.json").read_text())
    want = {"speedup", "alpha", "tau", "mean_acceptance_length", "draft_acceptance_rate", "tokens_per_s_plain",
            "tokens_per_s_spec", "n_prompts", "k", "ngram_baseline.speedup"}
    want |= {f"accept_per_pos.{i}" for i in range(len(m["accept_per_pos"]))}
    assert {("metrics.json", k) for k in want} <= seen
    k_curve = {("report/k-curve.json", f"rows.{i}.{f}") for i in (0, 1) for f in ("mean_acceptance_length", "speedup")}
    assert k_curve <= seen
    for b in (1, 2):
        assert {(f"report/batch-{b}.json", f) for f in ("speedup", "match_rate", "n_divergences", "controlled.speedup",
                                                        "controlled.tokens_per_s", "controlled.k_chosen")} <= seen
    for t in ("0", "1"):
        assert {(f"report/temperature-{t}.json", f) for f in ("speedup", "alpha", "mean_acceptance_length")} <= seen


def test_no_external_url_and_no_script(run, rendered):
    page, _ = rendered
    text = (run / "report.html").read_text()
    assert "<script" not in text and "<link" not in text
    assert page.links and all(u.startswith(("data:image/png;base64,", "#")) for u in page.links), \
        [u[:60] for u in page.links if not u.startswith(("data:", "#"))]
    assert "http://" not in text and "https://" not in text


def test_every_figure_carries_its_provenance(run, rendered):
    page, _ = rendered
    m = json.loads((run / "metrics.json").read_text())
    for f in page.figures:
        cap = f["caption"]
        assert set(cap) == set(CAPTION_FIELDS) and all(v.strip() for v in cap.values()), cap
        assert cap["command"].startswith("command: draftsmith distill --recipe recipes/code.yaml")
        assert m["target"] in cap["target"] and m["checkpoint"] in cap["draft"] and "heldout.jsonl" in cap["prompts"]
        assert "UTC" in cap["date"]


def test_the_batch_curve_claims_exactness_only_where_measured(run):
    """Each batch size's speculative output was compared with plain decoding at that batch size; in fp32
    with a tiny target they agree, and the page says exactness holds per measured batch size only. The 2
    prompts are cycled so that each decoder runs report.batch_turns (3) batches at every batch size."""
    text = (run / "report.html").read_text()
    for b in (1, 2):
        r = json.loads((run / "report" / f"batch-{b}.json").read_text())
        assert r["batch_size"] == b and r["n_sequences"] == 3 * b and r["match_rate"] == 1.0 and r["exact"] is True
    assert "Exactness is claimed only at the batch sizes measured" in text


def test_the_batch_curve_shows_the_controller_and_the_vllm_k_table(run, rendered):
    """Beside fixed K, the K controller at every batch size (fp32 on a tiny target: its output exact too), and
    the K it settled on per batch size as vLLM's num_speculative_tokens_per_batch_size, as Chromium renders it."""
    from pipeline.sweeps import settled_k, vllm_k_schedule

    page, _ = rendered
    points = []
    for b in (1, 2):
        c = json.loads((run / "report" / f"batch-{b}.json").read_text())["controlled"]
        assert c["exact"] is True and c["match_rate"] == 1.0 and c["k_chosen"] == settled_k(c["k_choices"], c["k_warmup_choices"])
        assert c["tokens_per_s"] > 0 and 0 <= c["spec_off_fraction"] <= 1
        points.append((b, c["k_chosen"]))
        # each turn's own ratio over plain's, 3 turns; exact outputs make the speedup their time-weighted mean
        r = json.loads((run / "report" / f"batch-{b}.json").read_text())
        for point in (r, c):
            assert len(point["speedup_turns"]) == 3
            assert min(point["speedup_turns"]) - 1e-9 <= point["speedup"] <= max(point["speedup_turns"]) + 1e-9
    ranges = {n.get("data-key") for n in page.numbers if "speedup_turns" in (n.get("data-key") or "")}
    assert any(k.startswith("controlled.speedup_turns.") for k in ranges) and any(k.startswith("speedup_turns.") for k in ranges)
    want = json.dumps({"num_speculative_tokens": max(max(k for _, k in points), 1),
                       "num_speculative_tokens_per_batch_size": vllm_k_schedule(points)})
    assert want in page.text
    assert f"--k-by-batch {shlex.quote(json.dumps(vllm_k_schedule(points)))}" in page.text


def test_vllm_k_schedule_obeys_vllms_rules():
    """vLLM 0.32 (vllm/v1/spec_decode/dynamic/utils.py) wants inclusive [start, end, K] ranges, the first from
    1, sorted and not overlapping, K >= 0; equal neighbours merge."""
    from pipeline.engines.draftsmith_vllm.proposer import k_table_ranges
    from pipeline.sweeps import settled_k, vllm_k_schedule

    assert vllm_k_schedule([(16, 0), (1, 3), (4, 2), (2, 3), (8, 0)]) == [[1, 2, 3], [3, 4, 2], [5, 16, 0]]
    assert vllm_k_schedule([(4, 1)]) == [[1, 4, 1]]
    sched = vllm_k_schedule([(1, 4), (2, 2), (32, 1)])
    assert sched[0][0] == 1 and all(a <= b for a, b, _ in sched)
    assert all(prev[1] < nxt[0] for prev, nxt in zip(sched, sched[1:])) and all(k >= 0 for *_, k in sched)
    for points in ([(16, 0), (1, 3), (4, 2), (2, 3), (8, 0)], [(4, 1)], [(1, 4), (2, 2), (32, 1)]):
        k_table_ranges(vllm_k_schedule(points))  # what vLLM and `draftsmith export --k-by-batch` accept
    assert settled_k([0, 0, 0, 4, 4, 2, 2, 1, 2], 5) == 2 and settled_k([0, 0, 0, 4, 4, 0, 3, 0], 5) == 0


def test_the_temperature_curve_of_a_hybrid_verifies_trees(run, chromium, tmp_path):
    """A draft served as a hybrid verifies token trees when sampling too (issue 33): its temperature curve says
    which share of rounds did, from the decoder's own count, as Chromium renders it; a bare draft's says none."""
    from eval import draft_dir

    ckpt = run / "train" / json.loads((run / "train" / "manifest.json").read_text())["checkpoints"][0]
    hybrid = tmp_path / "hybrid"
    shutil.copytree(ckpt, hybrid)
    draft_dir.write_meta(hybrid, draft_dir.read_meta(hybrid) | {"proposer": "hybrid"})  # as evaluate promotes one
    out = tmp_path / "hybrid.html"
    assert main(["report", "--domain", "code", "--run-dir", str(run), "--draft", str(hybrid), "--out", str(out),
                 "report.ks=[1]", "report.batch_sizes=[1]", "report.temperatures=[1.0]"]) == 0
    cached = list((run / "report").glob("custom-*/temperature-1.json"))  # this draft's curves, beside the run's
    assert len(cached) == 1
    point = json.loads(cached[0].read_text())
    assert point["temperature"] == 1.0 and point["sampling"]["temperature"] == 1.0 and point["tree_share"] > 0
    dom = _chromium(chromium, tmp_path, "--dump-dom", out.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    shares = [n for n in Page(dom.stdout).numbers if n.get("data-key") == "tree_share"]
    assert [json.loads(n["data-value"]) for n in shares] == [point["tree_share"]]
    bare = [json.loads((run / "report" / f"temperature-{t}.json").read_text()) for t in ("0", "1")]
    assert all(p["tree_share"] == 0 for p in bare)  # the fixture's draft is promoted bare (evaluate.hybrid=false)


def test_rerun_reads_the_curves_back(run, tmp_path, monkeypatch):
    """The report written again measures nothing: every curve point is read back from run_dir/report/."""
    import pipeline.sweeps as sweeps

    def measured(*a, **kw):
        raise AssertionError("a cached curve point was measured again")

    monkeypatch.setattr(sweeps, "decode_together", measured)
    monkeypatch.setattr(sweeps, "SpeculativeDecoder", measured)
    out = write_html_report(run, out=tmp_path / "again.html", command="draftsmith report --domain code")
    ours = [n for n in Page(out.read_text()).numbers if "data-src" in n]
    before = [n for n in Page((run / "report.html").read_text()).numbers if "data-src" in n]
    assert ours == before


def test_report_cli_on_other_prompts_with_categories(run, tmp_path):
    """`draftsmith report --draft --prompts` measures that draft (and the n-gram baseline) on those prompts:
    a row per category, the worst prompts listed by their beginnings, HTML-escaped."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "def f(x):\n    \"\"\"<script>alert(1)</script> & co\"\"\"\n", "category": "docstrings"},
            {"prompt": "def g(a, b):\n    return a + b\n", "category": "arithmetic"},
            {"messages": [{"role": "user", "content": "Write <b>bold</b> code"}], "category": "chat"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "custom.html"
    ckpt = run / "train" / json.loads((run / "train" / "manifest.json").read_text())["checkpoints"][0]
    assert main(["report", "--domain", "code", "--run-dir", str(run), "--draft", str(ckpt), "--prompts", str(prompts),
                 "--out", str(out), "report.n_prompts=3", "report.curves=false"]) == 0
    text = out.read_text()
    assert "<script" not in text and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in text
    assert "&lt;b&gt;bold&lt;/b&gt;" in text
    for c in ("docstrings", "arithmetic", "chat"):
        assert f"category {c}" in text
    page = Page(text)
    speed = [n for n in page.numbers if n.get("data-key") == "draft.speedup"]
    assert speed
    main_json = run / speed[0]["data-src"]  # this draft and prompt set's own directory, beside the run's curves
    assert main_json.parent.name.startswith("custom-") and main_json.parent.parent == run / "report"
    measured = json.loads(main_json.read_text())
    assert json.loads(speed[0]["data-value"]) == measured["draft"]["speedup"]
    assert len(measured["draft"]["stats"]["per_prompt"]) == 3 and measured["draft"]["source"] == str(ckpt)
    assert f"{ckpt}" in Page(text).figures[0]["caption"]["draft"]


def test_report_without_curves_and_bad_input(run, tmp_path, capsys):
    out = tmp_path / "nocurves.html"
    assert main(["report", "--domain", "code", "--run-dir", str(run), "--out", str(out), "report.curves=false"]) == 0
    page = Page(out.read_text())
    assert page.h2 == [title for _, title in SECTIONS]
    assert out.read_text().count("report.curves is false") == 3
    assert main(["report", "--domain", "code", "--runs-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("draftsmith: error: no run under") and "draftsmith distill" in err[-1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    assert main(["report", "--domain", "code", "--run-dir", str(run), "--prompts", str(bad), "--out",
                 str(tmp_path / "bad.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"draftsmith: error: {bad}:2: each line needs a 'prompt' string or a 'messages' list"
    assert not (tmp_path / "bad.html").exists()


def test_report_shows_the_registry_champions(run, tmp_path):
    """With a registry (pipeline.registry): the champion this run's draft replaced is a baseline, and the
    history lists every champion with the traffic rows it saw; `draftsmith report` picks the champion's run."""
    from pipeline import registry
    domain = tmp_path / "runs" / "code"
    old, new = domain / "20260101-000000-aaaa", domain / run.name
    for d in (old, new):
        shutil.copytree(run, d, symlinks=True, ignore=shutil.ignore_patterns("report.html"))
    m = json.loads((run / "metrics.json").read_text())
    reg = registry.Registry(domain)
    first = reg.add(old / "best", run_dir=old, metrics=m | {"speedup": 1.25}, kind="distill", hashes={},
                    traffic={"rows": 24})
    reg.promote(first["id"], {"reason": "first"})
    second = reg.add(new / "best", run_dir=new, metrics=m, kind="retrain", hashes={}, traffic={"rows": 40})
    reg.promote(second["id"], {"reason": "faster <b>"})
    assert main(["report", "--domain", "code", "--runs-dir", str(tmp_path / "runs"), "report.curves=false"]) == 0
    text = (new / "report.html").read_text()
    assert f"previous champion <code>{first['id']}</code>" in text and "1.25×" in text
    assert "<td>24</td>" in text and "<td>40</td>" in text and "faster &lt;b&gt;" in text
    assert len(Page(text).figures) == 4  # per position, worst prompts, baselines, history (curves off)


def test_bootstrap_interval_is_seeded_and_holds_the_estimate():
    walls = (0.5, 0.6, 0.8, 0.4, 0.7)
    result = {"stats": {"per_prompt": [{"n_tokens": 10, "wall_s": w} for w in walls]},
              "plain_stats": {"per_prompt": [{"n_tokens": 10, "wall_s": 1.0} for _ in walls]}}
    a, b = bootstrap_ci(result, 500, 0.95), bootstrap_ci(result, 500, 0.95)
    assert a == b and a[0] <= pooled_speedup(per_prompt(result)) <= a[1] and a[0] < a[1]
    one = {k: {"per_prompt": v["per_prompt"][:1]} for k, v in result.items()}
    assert bootstrap_ci(one, 500, 0.95) is None


def test_the_engine_acceptance_warnings_read_every_batch_at_the_runs_tolerance():
    """A verify-export run whose engine accepted 20% less than ours at batch 16 only is flagged (not only batch 1
    is read), at the tolerance the run judged with; a file from before the tolerance was recorded takes
    verify-export's default."""
    from pipeline.owner_report import acceptance_warnings
    from pipeline.verify_export import TOLERANCE

    def run(ratios: dict, **kw) -> dict:
        batches = {str(b): {"vs_ours_tau": r} for b, r in ratios.items()}
        return {"vllm": batches[str(min(ratios))], "vllm_batches": batches, **kw}

    assert acceptance_warnings([("v.json", run({1: 1.0, 16: 1.02}))]) == []
    low = acceptance_warnings([("v.json", run({1: 1.0, 16: 0.8}))])
    assert len(low) == 1 and "accepts less" in low[0] and f"v.json (tolerance {TOLERANCE:.0%})" in low[0]
    assert acceptance_warnings([("v.json", run({1: 1.0, 16: 0.8}, tolerance=0.25))]) == []
    high = acceptance_warnings([("a.json", run({1: 1.15})), ("b.json", run({1: 0.85, 16: 1.3}, tolerance=0.2))])
    assert len(high) == 1 and "accepts more" in high[0]
    assert f"a.json (tolerance {TOLERANCE:.0%})" in high[0] and "b.json (tolerance 20%)" in high[0]
