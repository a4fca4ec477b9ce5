"""Loaded first by the processes that ``tests/test_stage_formats.py`` spawns with this folder on ``PYTHONPATH``:
with ``GOODPUT_TEST_HOLD_TOKENIZER`` set (a folder), a stage's tokenizer worker announces itself there (a file
named after its pid) once it has a file to tokenize, then waits, so that the test acts on a worker that is
mid-file, whatever the machine's speed."""

import os

_HOLD = os.environ.get("GOODPUT_TEST_HOLD_TOKENIZER")

if _HOLD:
    import threading

    import components.stage.tokens as _tokens

    _tokenize = _tokens._tokenize_file

    def _held(job):
        open(os.path.join(_HOLD, str(os.getpid())), "w").close()
        threading.Event().wait(120)   # the test kills this process long before
        return _tokenize(job)

    _tokens._tokenize_file = _held
