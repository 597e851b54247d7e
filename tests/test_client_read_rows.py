"""`client.read_rows`: some rows of a stored tensor, as an embedding's lookup needs them.

A tensor only on NVMe is read in whole 1 MiB checksum blocks, only those holding a wanted row,
and is not loaded into the CPU tier; a resident one is copied from its slice. Each test checks
the rows bit for bit against indexing the tensor in this process. The row size (1237 float32,
4948 bytes) does not divide a block, so some rows straddle two blocks, and two chunks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from test_daemon_nvme import MiB, Store, store, tier_counters, tier_of  # noqa: F401
from infinity.errors import InvalidRequestError

ROWS, WIDTH = 3001, 1237  # 14.8 MB: on NVMe only once written with write_from


def table(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed))


def test_rows_of_a_tensor_on_nvme_only_come_from_the_blocks_that_hold_them(
        store: Store) -> None:  # noqa: F811
    daemon = store.start()
    with daemon.connect("rows") as client:
        values = table(1)
        client.write_from("emb", values)
        assert tier_of(client, "emb") == "nvme"
        rows = torch.tensor([2999, 5, 5, 1500, 0, 3000, 212, 211])  # repeats, any order
        out = torch.empty(len(rows), WIDTH)
        before = tier_counters(client)["stream_read_bytes"]
        client.read_rows("emb", rows, out)
        assert torch.equal(out, values[rows])
        read = tier_counters(client)["stream_read_bytes"] - before
        assert 0 < read <= 8 * MiB, read  # a few blocks, not the 14.8 MB table
        assert tier_of(client, "emb") == "nvme"  # not loaded into the CPU tier


def test_rows_that_straddle_two_chunks_are_whole(store: Store) -> None:  # noqa: F811
    daemon = store.start(**{"nvme.stream_chunk_bytes": MiB})  # one block per chunk
    with daemon.connect("rows") as client:
        values = table(2)
        client.write_from("emb", values)
        straddling = [row for row in range(ROWS)
                      if (row * WIDTH * 4) // MiB != ((row + 1) * WIDTH * 4 - 1) // MiB]
        rows = torch.tensor(straddling + list(range(0, ROWS, 97)))
        out = torch.empty(len(rows), WIDTH)
        client.read_rows("emb", rows, out)
        assert torch.equal(out, values[rows])


def test_rows_of_a_resident_tensor_are_copied_from_its_slice(client: Any) -> None:
    values = table(3)[:301]
    client.put("small", values)
    rows = torch.tensor([300, 0, 17, 17])
    out = torch.empty(len(rows), WIDTH)
    client.read_rows("small", rows, out)
    assert torch.equal(out, values[rows])


def test_a_row_past_the_end_is_a_typed_error_and_the_daemon_serves_on(client: Any) -> None:
    values = table(4)[:11]
    client.put("small", values)
    with pytest.raises(InvalidRequestError, match="rows"):
        client.read_rows("small", torch.tensor([3, 11]), torch.empty(2, WIDTH))
    with pytest.raises(InvalidRequestError, match="row size"):
        client.read_rows("small", torch.tensor([3]), torch.empty(1, WIDTH + 1))
    out = torch.empty(1, WIDTH)
    client.read_rows("small", torch.tensor([10]), out)
    assert torch.equal(out[0], values[10])
