"""Which split each staged file, or each document, goes to; and where that decision came from.

    plan = resolve_splits(rels, train_glob=(), val_glob=(), val_percent=5, readme=None)
    plan.rules["data/train-00000-of-00004.parquet"]     # "train", "val", "documents", or absent: left out
    document_split("id:42", 5)                           # the split of one document of a "documents" file

In order, the first that applies decides (``plan.source`` records which, for the manifest's ``split_source``):

1. ``globs``: ``train_glob`` / ``val_glob`` (the include/exclude syntax, ``components.stage.formats.matches``).
   A file matching ``val_glob`` is validation; else one matching ``train_glob`` is training. With one of the
   two given, every other file is the other split; with both, a file matching neither is left out.
2. ``readme``: the ``configs`` of the dataset card's YAML header (``README.md`` of a Hugging Face dataset
   repository): the ``data_files`` of the config named ``default`` (else the first), by split.
3. ``dataset_info``: the split names the card's ``dataset_info`` (else ``dataset_infos.json``) declares, for the
   config named ``default`` (else the first): a file belongs to a declared split when its name starts with the
   split's name followed by ``-``, ``.`` or ``_`` (``validation_matched-00000-of-00001.parquet``), or a directory
   on its path is named so. The validation split is the declared one named ``validation`` (``valid``, ``val``,
   ``dev``), else the first whose name starts with one of those (``validation_matched``), else test's likewise.
4. ``layout``: split names in file names, else in directory names, as Hugging Face ``datasets`` finds them
   (``train-00000-of-00004.parquet``, ``validation-*.jsonl``, ``data/test/*``): used when some file names a
   validation or test split.
5. ``document``: no split in the source. Each document of a JSONL or Parquet file is drawn by a hash of its
   key (its ``id``, or its file's path and position), ``val_percent`` of them for validation; a plain text
   file is one document, drawn by a hash of its path. Adding files moves no document between splits. With
   ``val_tokens`` instead, the share is chosen from a budget of tokens (``components.stage.budget``).

In 2 to 4, ``validation`` (``valid``, ``val``, ``dev``) is the validation split; ``test`` is used in its
place only when the source has none; other files (another split's, or no split's: the card, ``.gitattributes``)
are left out.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass, field

from components.stage.formats import detect_format, matches

# Hugging Face datasets' split keywords and the characters that may surround one in a name
# (datasets.data_files.SPLIT_KEYWORDS, NON_WORDS_CHARS).
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_SEP = r"[-._ 0-9]"
_IN_NAME = {split: re.compile(rf"(?:^|{_SEP})(?:{'|'.join(words)}){_SEP}") for split, words in SPLIT_KEYWORDS.items()}
_IN_DIR = {split: re.compile(rf"(?:^|{_SEP})(?:{'|'.join(words)})(?:$|{_SEP})")
           for split, words in SPLIT_KEYWORDS.items()}
README = "README.md"
DATASET_INFOS = "dataset_infos.json"     # the older place of a Hugging Face dataset's dataset_info
LEFT_OUT_LISTED = 100          # left-out files named in the manifest (all are counted)


@dataclass
class SplitPlan:
    """``rules``: path -> ``train``, ``val`` or ``documents`` (split by document); a path not in it is left
    out. ``source``: how the splits were found (the manifest's ``split_source``)."""

    rules: dict[str, str]
    source: dict = field(default_factory=dict)

    def threshold(self) -> int:
        """Documents of a ``documents`` file whose key hash is below this are validation: the budget's
        (``components.stage.budget``), else ``val_percent``'s."""
        return self.source["threshold"] if "threshold" in self.source else val_threshold(
            self.source.get("val_percent", 0))


def val_threshold(val_percent: int) -> int:
    """Documents whose 64-bit key hash is below this are validation."""
    return val_percent * (1 << 64) // 100


def document_split(key: str, threshold: int) -> str:
    """The split of a document by its key (``val_threshold``): the same key always lands on the same side."""
    return "val" if int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") < threshold else "train"


def file_split(rel: str, val_percent: int) -> str:
    """The split of a whole file (a plain text file: one document) by its path."""
    from trainer.data import split_of

    return split_of(rel, val_percent)


def _named_split(rel: str, in_dirs: bool) -> str | None:
    parts = rel.lower().split("/")
    names = parts[-2::-1] if in_dirs else parts[-1:]       # the nearest directory first
    pattern = _IN_DIR if in_dirs else _IN_NAME
    for name in names:
        for split, regex in pattern.items():
            if regex.search(name):
                return split
    return None


def _by_names(rels: list[str]) -> dict[str, str | None] | None:
    """Split names found in file names (else directory names), as Hugging Face datasets looks for them; None
    when no file names a validation or test split."""
    for in_dirs in (False, True):
        named = {rel: _named_split(rel, in_dirs) for rel in rels}
        if any(s in ("validation", "test") for s in named.values()):
            return named
    return None


def _card_header(readme: bytes) -> dict:
    """The YAML header of a dataset card (``---`` ... ``---``); {} when it has none or it is not YAML."""
    import yaml

    text = readme.decode("utf-8", "replace")
    if not text.startswith("---"):
        return {}
    try:
        header = yaml.safe_load(text.split("---", 2)[1])
    except yaml.YAMLError:
        return {}
    return header if isinstance(header, dict) else {}


def _readme_config(readme: bytes) -> tuple[str, dict[str, list[str]]] | None:
    """(config name, {split: globs}) from a dataset card's ``configs``; None when it has none."""
    configs = _card_header(readme).get("configs")
    if not isinstance(configs, list) or not configs:
        return None
    config = next((c for c in configs if isinstance(c, dict) and c.get("config_name") == "default"), configs[0])
    files = config.get("data_files") if isinstance(config, dict) else None
    if isinstance(files, (str, list)) and not (isinstance(files, list) and files and isinstance(files[0], dict)):
        files = [{"split": "train", "path": files}]
    if not isinstance(files, list):
        return None
    out: dict[str, list[str]] = {}
    for entry in files:
        if isinstance(entry, dict) and "split" in entry and "path" in entry:
            paths = entry["path"] if isinstance(entry["path"], list) else [entry["path"]]
            out.setdefault(str(entry["split"]), []).extend(str(p) for p in paths)
    return (str(config.get("config_name", "default")), out) if out else None


def _declared_splits(readme: bytes | None, infos: bytes | None) -> tuple[str, str, dict[str, int | None]] | None:
    """(where, config name, {split name: num_examples}) from the card's ``dataset_info``, else from
    ``dataset_infos.json``; None when neither declares a split."""
    import json

    found: list[tuple[str, str, object]] = []       # (where, config, that config's splits)
    info = _card_header(readme).get("dataset_info") if readme is not None else None
    for entry in info if isinstance(info, list) else [info]:
        if isinstance(entry, dict):
            found.append((README, str(entry.get("config_name", "default")), entry.get("splits")))
    if not found and infos is not None:
        try:
            configs = json.loads(infos)
        except ValueError:
            configs = None
        if isinstance(configs, dict):
            found = [(DATASET_INFOS, str(name), c.get("splits")) for name, c in configs.items() if isinstance(c, dict)]
    if not found:
        return None
    where, config, splits = next((f for f in found if f[1] == "default"), found[0])
    if isinstance(splits, dict):                     # dataset_infos.json: {name: {name, num_examples, ...}}
        splits = [{"name": k, **v} if isinstance(v, dict) else {"name": k} for k, v in splits.items()]
    declared = {str(s["name"]): s.get("num_examples") for s in splits or [] if isinstance(s, dict) and "name" in s}
    return (where, config, declared) if declared else None


def _declared_split_of(rel: str, names: list[str]) -> str | None:
    """The declared split ``rel`` belongs to (``names`` longest first): its file name starts with the name and a
    ``-``, ``.`` or ``_``, or a directory on its path is the name."""
    parts = rel.split("/")
    for name in names:
        if name in parts[:-1] or re.match(rf"{re.escape(name)}(?:[-._]|$)", parts[-1]):
            return name
    return None


def _by_declared(rels: list[str], declared: dict[str, int | None]) -> tuple[dict[str, str | None], str] | None:
    """{rel: train / validation / test / another declared name / None}, and the declared name used for
    validation; None unless files belong to the declared training split and to a validation or test one."""
    def first(split: str) -> str | None:
        words = SPLIT_KEYWORDS[split]
        return next((n for n in declared if n.lower() in words), None) or next(
            (n for n in declared if re.match(rf"(?:{'|'.join(words)})_", n.lower())), None)

    val = first("validation") or first("test")
    train = first("train")
    if val is None or train is None:
        return None
    canonical = {train: "train", val: "validation" if val == first("validation") else "test"}
    found = {rel: _declared_split_of(rel, sorted(declared, key=len, reverse=True)) for rel in rels}
    named = {rel: canonical.get(split, split) for rel, split in found.items()}
    if "train" not in named.values() or canonical[val] not in named.values():
        return None
    return named, val


def _card_glob(rel: str, pattern: str) -> bool:
    # data_files paths are globs from the repository's root; ** crosses directories as * does in fnmatch.
    return fnmatch.fnmatchcase(rel, pattern.replace("**/", "*").replace("**", "*"))


def _named_plan(named: dict[str, str | None], by: str, **extra) -> SplitPlan:
    """Validation (else test) is the validation split; train, or with no file named train every file that
    names no split (but the card and dot files), the training split; the rest is left out."""
    val_name = "validation" if "validation" in named.values() else "test"
    has_train = "train" in named.values()
    rules: dict[str, str] = {}
    for rel, split in named.items():
        name = rel.rsplit("/", 1)[-1]
        if split == val_name:
            rules[rel] = "val"
        elif split == "train" or (split is None and not has_train and name not in (README, DATASET_INFOS)
                                  and not name.startswith(".")):
            rules[rel] = "train"
    return SplitPlan(rules, {"by": by, "val_from": val_name, **extra,
                             **_left_out([rel for rel in named if rel not in rules])})


def _left_out(rels: list[str]) -> dict:
    return {"left_out_files": len(rels), "left_out": sorted(rels)[:LEFT_OUT_LISTED]}


def resolve_splits(rels: list[str], *, train_glob: tuple[str, ...] = (), val_glob: tuple[str, ...] = (),
                   val_percent: int = 5, data_format: str = "auto", readme: bytes | None = None,
                   dataset_infos: bytes | None = None, val_tokens: int = 0) -> SplitPlan:
    """The split of every staged path (see the module's docstring); ``readme`` is the source's README.md,
    ``dataset_infos`` its dataset_infos.json. With ``val_tokens``, every file of a source split by document is
    split by document (a plain text file is one document keyed by its path) and ``components.stage.budget``
    sets the threshold."""
    if train_glob or val_glob:
        rules = {}
        for rel in rels:
            if val_glob and matches(rel, list(val_glob), []):
                rules[rel] = "val"
            elif train_glob and matches(rel, list(train_glob), []):
                rules[rel] = "train"
            elif not (train_glob and val_glob):
                rules[rel] = "val" if train_glob else "train"
        return SplitPlan(rules, {"by": "globs", "train_glob": list(train_glob), "val_glob": list(val_glob),
                                 **_left_out([rel for rel in rels if rel not in rules])})
    card = _readme_config(readme) if readme is not None else None
    if card is not None:
        config, globs = card
        named: dict[str, str | None] = {}
        for rel in rels:
            hits = [split for split, patterns in globs.items() if any(_card_glob(rel, p) for p in patterns)]
            split = hits[0].lower() if hits else None
            named[rel] = next((k for k, words in SPLIT_KEYWORDS.items() if split in words), split)
        if any(s in ("validation", "test") for s in named.values()) and "train" in named.values():
            return _named_plan(named, "readme", config=config)
    declared = _declared_splits(readme, dataset_infos)
    by_declared = _by_declared(rels, declared[2]) if declared is not None else None
    if by_declared is not None:
        where, config, counts = declared
        named, val_from = by_declared
        return _named_plan(named, "dataset_info", declared_in=where, config=config, val_from=val_from,
                           declared=counts)
    named_in_paths = _by_names(rels)
    if named_in_paths is not None:
        return _named_plan(named_in_paths, "layout")
    key = "the record's id, else its file's path and position; a text file's path"
    if val_tokens:
        return SplitPlan({rel: "documents" for rel in rels}, {"by": "document", "key": key})
    rules = {rel: "documents" if detect_format(rel, data_format) != "text" else file_split(rel, val_percent)
             for rel in rels}
    return SplitPlan(rules, {"by": "document", "val_percent": val_percent, "key": key})
