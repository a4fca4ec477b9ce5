"""The dataset's tokenizer: the byte vocabulary, a Hugging Face ``tokenizers`` file, or a BPE trained here.

``tokenizer`` stage parameter:

    bytes                     one token per byte, vocabulary 256, no EOS (the default; the demo's ByteGPT)
    /path/tokenizer.json      a ``tokenizers`` file on FSx or any directory
    /path/hf-model-dir        a Hugging Face model directory holding tokenizer.json (its
                              tokenizer_config.json names the EOS token)
    s3://bucket/key.json      the same from S3 (a prefix: its tokenizer.json and tokenizer_config.json)
    bpe:VOCAB                 a byte-level BPE of VOCAB tokens trained with ``tokenizers`` on the staged
                              training documents (the first ``bpe_sample_bytes`` of them, in path order)

Every tokenizer but ``bytes`` is staged next to the dataset as ``tokenizer/tokenizer.json`` and its
sha256, vocabulary size and EOS id go into the manifest. Documents are separated by the EOS token.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from trainer.durable import publish_file, temp_name
from trainer.s3url import is_s3_url, parse_s3_url

TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
BPE_EOS = "<|endoftext|>"
# Tried in order when the tokenizer does not name its EOS (GPT-2/Llama 3/Llama 2/T5 conventions).
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BPE_MIN_VOCAB = 256 + 1        # the byte alphabet and the EOS


@dataclass(frozen=True)
class TokenizerSpec:
    """A parsed ``tokenizer`` parameter."""

    kind: str                  # bytes | file | bpe
    spec: str                  # as given
    location: str = ""         # path or s3:// URI (kind file)
    vocab: int = 0             # kind bpe


@dataclass
class TokenizerInfo:
    """What the manifest records of the tokenizer (``path`` relative to the dataset directory)."""

    kind: str
    spec: str
    vocab_size: int
    eos_id: int | None
    eos_token: str | None = None
    sha256: str | None = None
    path: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def parse_tokenizer(spec: str) -> TokenizerSpec:
    """Check a ``tokenizer`` parameter before anything is staged (ValueError says what is wrong)."""
    spec = (spec or "bytes").strip()
    if spec == "bytes":
        return TokenizerSpec("bytes", spec)
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            raise ValueError(f"tokenizer {spec!r}: expected bpe:VOCAB with VOCAB a number, e.g. bpe:8192") from None
        if not BPE_MIN_VOCAB <= vocab <= 1 << 32:
            raise ValueError(f"tokenizer {spec!r}: the vocabulary must hold at least the 256 bytes and the EOS "
                             f"({BPE_MIN_VOCAB})")
        return TokenizerSpec("bpe", spec, vocab=vocab)
    if is_s3_url(spec):
        parse_s3_url(spec, "tokenizer")     # a bad URL is refused here, before anything is staged
        return TokenizerSpec("file", spec, location=spec)
    if "://" in spec:
        raise ValueError(f"tokenizer {spec!r}: use bytes, bpe:VOCAB, a tokenizer.json or model directory, or s3://")
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"tokenizer {spec!r}: {path} not found (give a tokenizer.json, or a Hugging Face model "
                         f"directory holding one)")
    return TokenizerSpec("file", spec, location=str(path))


def _s3_location(uri: str) -> tuple[str, str]:
    """(bucket, key of tokenizer.json) of an object URI or a model prefix."""
    url = parse_s3_url(uri, "tokenizer")
    return url.bucket, url.key if url.key.endswith(".json") else posixpath.join(url.key, TOKENIZER_FILE)


def check_tokenizer_source(spec: TokenizerSpec, endpoint_url: str | None = None) -> None:
    """An ``s3://`` tokenizer exists (ValueError if not): checked before any data is staged."""
    if not is_s3_url(spec.location):
        return
    from botocore.exceptions import BotoCoreError, ClientError

    from components.s3 import s3_client

    bucket, key = _s3_location(spec.location)
    try:
        s3_client(endpoint_url, max_attempts=3).head_object(Bucket=bucket, Key=key)
    except (BotoCoreError, ClientError) as e:
        raise ValueError(f"tokenizer {spec.spec!r}: cannot fetch s3://{bucket}/{key}: {e}") from e


def _fetch_s3(uri: str, dest: Path, endpoint_url: str | None) -> tuple[Path, dict | None]:
    """tokenizer.json (and tokenizer_config.json, if there) from an object or a prefix, into ``dest``."""
    from botocore.exceptions import ClientError

    from components.s3 import s3_client

    bucket, key = _s3_location(uri)
    client = s3_client(endpoint_url, max_attempts=5)
    try:
        client.download_file(bucket, key, str(dest))
    except ClientError as e:
        raise ValueError(f"tokenizer {uri!r}: cannot fetch s3://{bucket}/{key}: {e}") from e
    try:
        body = client.get_object(Bucket=bucket, Key=posixpath.join(posixpath.dirname(key),
                                                                   "tokenizer_config.json"))["Body"].read()
        return dest, json.loads(body)
    except (ClientError, ValueError):
        return dest, None


def _eos(tokenizer, config: dict | None, spec: str) -> tuple[str, int]:
    named = (config or {}).get("eos_token")
    if isinstance(named, dict):
        named = named.get("content")
    for token in ([named] if named else []) + list(EOS_CANDIDATES):
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return token, tid
    raise ValueError(f"tokenizer {spec!r} has none of the EOS tokens {', '.join(EOS_CANDIDATES)} and no "
                     f"tokenizer_config.json naming one; documents need a separator")


def train_bpe(documents: Iterable[str], vocab: int):
    """A byte-level BPE (GPT-2 style) of ``vocab`` tokens, the EOS first, trained on ``documents``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BPE_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    return tok


def stage_tokenizer(spec: TokenizerSpec, dest: Path, *, endpoint_url: str | None = None,
                    documents: Iterable[str] | None = None) -> TokenizerInfo:
    """Put the tokenizer next to the dataset (``dest/tokenizer/tokenizer.json``) and describe it.

    ``documents`` feeds ``bpe:`` training (ignored otherwise). The file is written through a rename.
    """
    if spec.kind == "bytes":
        return TokenizerInfo("bytes", spec.spec, vocab_size=256, eos_id=None)
    from tokenizers import Tokenizer

    out_dir = Path(dest) / TOKENIZER_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / TOKENIZER_FILE
    tmp = temp_name(final)
    config = None
    if spec.kind == "bpe":
        tok = train_bpe(documents or [], spec.vocab)
        tmp.write_text(tok.to_str())
    elif is_s3_url(spec.location):
        _, config = _fetch_s3(spec.location, tmp, endpoint_url)
    else:
        tmp.write_bytes(Path(spec.location).read_bytes())
        cfg = Path(spec.location).with_name("tokenizer_config.json")
        if cfg.is_file():
            config = json.loads(cfg.read_text())
    try:
        tok = Tokenizer.from_file(str(tmp))
    except Exception as e:  # noqa: B902 - tokenizers raises a bare Exception for a malformed file
        tmp.unlink(missing_ok=True)
        raise ValueError(f"tokenizer {spec.spec!r} is not a Hugging Face tokenizers file: {e}") from e
    eos_token, eos_id = _eos(tok, config, spec.spec)
    publish_file(tmp, final)
    # The vocabulary size the model needs: one past the largest id (added tokens may leave gaps).
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    return TokenizerInfo(spec.kind, spec.spec, vocab_size=vocab_size, eos_id=eos_id,
                         eos_token=eos_token, sha256=hashlib.sha256(final.read_bytes()).hexdigest(),
                         path=f"{TOKENIZER_DIR}/{TOKENIZER_FILE}")
