"""A step's inputs laid out with numpy (tokenrouter/engine/step_inputs.py) against a plain per-token loop, and
the metadata every attention backend reads."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrouter.engine.model_runner import Chunk
from tokenrouter.engine.step_inputs import StepInputs, build_host_step
from tokenrouter.models.attention import TorchBackend

BLOCK = 4


def reference(chunks: list[Chunk]):
    """The per-token layout, written the plain way."""
    ids, pos, slots, rows, offsets = [], [], [], [], []
    row = 0
    for c in chunks:
        n = len(c.token_ids)
        ids += c.token_ids
        pos += list(range(c.start, c.start + n))
        slots += [c.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c.start, c.start + n)]
        offsets.append(len(rows))
        rows += list(range(row + n - c.num_outputs, row + n))
        row += n
    return ids, pos, slots, rows, offsets


@st.composite
def steps(draw):
    chunks, next_block = [], 0
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 9))
        start = draw(st.integers(0, 20))
        blocks = -(-(start + n) // BLOCK) + draw(st.integers(0, 2))  # tables may run past the context
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        chunks.append(Chunk(draw(st.lists(st.integers(0, 300), min_size=n, max_size=n)), start,
                            draw(st.permutations(table)), draw(st.integers(1, n))))
    return chunks


@settings(max_examples=150, deadline=None)
@given(steps())
def test_the_numpy_layout_is_the_per_token_layout(chunks):
    host = build_host_step(chunks, BLOCK, max_model_len=64)
    ids, pos, slots, rows, offsets = reference(chunks)
    assert host.input_ids.tolist() == ids and host.positions.tolist() == pos and host.slot_mapping.tolist() == slots
    assert (host.output_rows is None and rows == list(range(len(ids)))) or host.output_rows.tolist() == rows
    assert host.offsets == offsets
    assert host.seq_lens.tolist() == [c.start + len(c.token_ids) for c in chunks]
    for c, table, end in zip(chunks, host.block_tables, host.seq_lens):
        used = -(-int(end) // BLOCK)
        assert table[:used].tolist() == c.block_table[:used]


@settings(max_examples=60, deadline=None)
@given(steps())
def test_metadata_on_the_device_is_one_array_cut_into_fields(chunks):
    host = build_host_step(chunks, BLOCK, max_model_len=64)
    ids, positions, meta, rows = StepInputs(torch.device("cpu"), TorchBackend(), BLOCK).to_device(host)
    assert ids.tolist() == host.input_ids.tolist() and positions.tolist() == host.positions.tolist()
    assert meta.slot_mapping.dtype == torch.long and meta.slot_mapping.tolist() == host.slot_mapping.tolist()
    assert meta.query_start_loc.tolist() == [0, *np.cumsum(host.query_lens).tolist()]
    assert meta.seq_lens.tolist() == host.seq_lens.tolist() and meta.num_seqs == len(chunks)
    assert meta.block_tables.tolist() == host.block_tables.tolist()
    assert meta.max_query_len == max(len(c.token_ids) for c in chunks)
    assert (rows is None) == (host.output_rows is None)


@pytest.mark.parametrize("chunk,message", [
    (Chunk([], 0, [0]), "a chunk needs at least one token"),
    (Chunk([1], 64, list(range(17))), "sequence length 65 exceeds max_model_len=64"),
    (Chunk([1, 2], 3, [0]), "block table holds 4 slots, chunk needs 5"),
    (Chunk([1, 2], 0, [0], 3), r"num_outputs must be in \[1, 2\], got 3"),
])
def test_a_bad_chunk_is_refused_naming_the_problem(chunk, message):
    good = Chunk([1], 0, [5])
    with pytest.raises(ValueError, match=message):
        build_host_step([good, chunk], BLOCK, max_model_len=64)
