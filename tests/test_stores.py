"""Joining a store whose host starts later: the rank waits for it to listen, or says what is wrong."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainer.parallel import free_port, wait_until_listening


def test_a_rank_joins_a_store_whose_host_starts_after_it():
    port, hosting = free_port(), threading.Event()
    stores = []

    def host_later():   # the host is late: the rank below is already waiting for it
        time.sleep(0.3)
        hosting.set()
        stores.append(dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=10)))

    host = threading.Thread(target=host_later, daemon=True)
    host.start()
    wait_until_listening("127.0.0.1", port, timeout_s=10)
    assert hosting.is_set()   # it returned because the host listens, not before
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    host.join(timeout=10)     # the host's constructor may still be returning after it began to listen
    assert stores[0].get("k") == b"v"


def test_a_store_that_never_comes_is_reported_with_its_address():
    port = free_port()
    with pytest.raises(TimeoutError, match=f"nothing listens on 127.0.0.1:{port}.*rank 0"):
        wait_until_listening("127.0.0.1", port, timeout_s=0.2)
