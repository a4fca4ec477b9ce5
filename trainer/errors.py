"""The errors that decide which recovery layer handles a failure (imported by every layer, importing nothing)."""


class HelperHung(RuntimeError):
    """A helper process of this rank (its checkpoint writer, its rank monitor) is gone or stopped answering.

    Restarting the training function in the same process would meet the same helper, so the in-process
    layer passes it on to the in-job one, which starts the rank and its helpers afresh."""


class ChecksumMismatch(Exception):
    """A copy of the state whose bytes are not the bytes that were staged or uploaded (or that records no
    checksums): a checkpoint, memory snapshot or peer copy (``trainer.checkpoint.integrity``), or a file
    downloaded from the S3 mirror against the CRC32 S3 stored (``trainer.mirror``)."""


class MirrorFailed(RuntimeError):
    """The S3 checkpoint mirror failed and ``--require-mirror`` says that ends the run."""


# Errors that come back the same on every attempt (settings, data format, paths), and a failure the settings
# make fatal: no layer retries them.
RECURRING = (ValueError, TypeError, KeyError, FileNotFoundError, NotADirectoryError, PermissionError, MirrorFailed)


def recurring_cause(e: BaseException) -> BaseException | None:
    """``e`` or its cause, if it is an error that every attempt would meet again; else None.

    One raised while a failure that a restart may cure was being handled (by the teardown after it, say: torch's
    ValueError once the process group is gone) is that failure's consequence, not a recurring error."""
    context = None if e.__suppress_context__ else e.__context__
    if isinstance(e, RECURRING) and (context is None or isinstance(context, RECURRING)):
        return e
    return e.__cause__ if isinstance(e.__cause__, RECURRING) else None
