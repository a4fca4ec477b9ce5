"""``s3://BUCKET[/KEY]`` URLs: the one parser every S3 location goes through (torch-free; the components
use it too).

    url = parse_s3_url("s3://models/llama3-1b", "init_from")    # S3Url(bucket="models", key="llama3-1b")
    url.prefix                                                   # "llama3-1b/": the key as a directory
"""

from __future__ import annotations

import dataclasses

__all__ = ["SCHEME", "S3Url", "is_s3_url", "parse_s3_url"]

SCHEME = "s3://"


@dataclasses.dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str = ""       # without a leading slash; a prefix or an object's key, as given

    @property
    def prefix(self) -> str:
        """The key as a directory: ``""`` or ending in ``/`` (``s3://b/data`` must not match ``data2/...``)."""
        key = self.key.strip("/")
        return f"{key}/" if key else ""

    def join(self, rel: str) -> S3Url:
        """The object ``rel`` under this URL's prefix."""
        return S3Url(self.bucket, self.prefix + rel.lstrip("/"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def is_s3_url(value: str) -> bool:
    """Whether ``value`` names an S3 location (anything else with a ``://`` is a scheme we do not serve)."""
    return value.startswith(SCHEME)


def parse_s3_url(url: str, what: str = "S3 URL") -> S3Url:
    """``s3://bucket/key`` -> ``S3Url(bucket, key)``; ValueError naming ``what`` (the option) if it is not one."""
    if not is_s3_url(url):
        raise ValueError(f"{what} {url!r}: not an S3 URL; expected s3://BUCKET[/PREFIX]")
    bucket, _, key = url[len(SCHEME):].partition("/")
    if not bucket or any(c.isspace() for c in bucket):
        raise ValueError(f"{what} {url!r}: no bucket name; expected s3://BUCKET[/PREFIX]")
    return S3Url(bucket, key.lstrip("/"))
