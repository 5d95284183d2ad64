"""The torch spec's packed micro-batches apply RoPE once over the packed rows with the table
DocumentRotary gathers at each token's position in its document (megaforge.trainer.megatron.layers),
instead of megatron's thd RoPE that splits q/k by document in every layer. Both must rotate every
token by the same angles: the same float32 ops on the same values (cos/sin of the same table rows,
one multiply-add), so the results are equal to 1e-6 absolute on inputs of magnitude ~1 (rounding of
a differently-blocked elementwise kernel at most; measured 0)."""
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from megaforge.trainer.megatron.layers import DOCUMENTS_FORMAT, DocumentRotary, has_document_rotary, use_document_rotary  # noqa: E402
from megaforge.trainer.megatron.packing import pack  # noqa: E402


@pytest.fixture(scope="module")
def one_rank_group():
    """A real one-rank gloo group: megatron's thd RoPE reads the CP group's size and rank."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group([0], backend="gloo")
    if started:
        dist.destroy_process_group()


@pytest.fixture
def rope_on_cpu(monkeypatch):
    """megatron's RotaryEmbedding moves its frequencies to ``torch.cuda.current_device()`` at first use."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [12], [7, 7]])
def test_document_table_rotates_like_megatrons_thd_rope(one_rank_group, rope_on_cpu, lengths):
    hn, np_ = 16, 3
    cfg = TransformerConfig(num_layers=1, hidden_size=np_ * hn, num_attention_heads=np_, apply_rope_fusion=False)
    inner = RotaryEmbedding(hn, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    rot = DocumentRotary(inner)
    tokens = torch.arange(sum(lengths)).reshape(1, -1) % 7
    # one row per document (right-padded), packed as the trainer packs them
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        rows[i, :n] = tokens[0, sum(lengths[:i]):sum(lengths[:i]) + n]
    thd = pack(rows, torch.tensor(lengths), host_cu_seqlens=True).packed_seq_params
    docs = pack(rows, torch.tensor(lengths), host_cu_seqlens=True, documents=True).packed_seq_params
    assert thd.qkv_format == "thd" and docs.qkv_format == DOCUMENTS_FORMAT
    assert docs.rope_positions.tolist() == [j for n in lengths for j in range(n)]
    L = max(docs.max_seqlen_q, docs.max_seqlen_kv)
    q = torch.randn(sum(lengths), np_, hn, generator=torch.Generator().manual_seed(len(lengths)))
    want = apply_rotary_pos_emb(q, inner(L, packed_seq=True), config=cfg, cu_seqlens=thd.cu_seqlens_q_padded,
                                cp_group=one_rank_group)
    assert rot.get_rotary_seq_len(None, None, None, cfg, docs) == L
    table = rot(L)  # [t, 1, 1, hn]: the packed rows' angles, made once for every layer
    assert table.shape == (sum(lengths), 1, 1, hn)
    got = apply_rotary_pos_emb(q[:, None], table, config=cfg, cu_seqlens=None, cp_group=one_rank_group)[:, 0]
    assert (got - want).abs().max() <= 1e-6
    # any other input (plain rows, thd): megatron's table as it is
    assert rot.get_rotary_seq_len(None, None, None, cfg, thd) == L and torch.equal(rot(L), inner(L))
    assert rot.get_rotary_seq_len(None, None, q[:, None], cfg, None) == sum(lengths)
    assert torch.equal(rot(sum(lengths)), inner(sum(lengths)))


def test_only_megatrons_plain_rope_is_wrapped_and_cp_keeps_thd():
    class Model(torch.nn.Module):
        pass

    m = Model()
    m.rotary_pos_emb = RotaryEmbedding(8, rotary_percent=1.0, use_cpu_initialization=True)
    use_document_rotary(m)
    assert has_document_rotary(m) and list(m.state_dict()) == []  # no parameters or buffers added
    wrapper = Model()
    wrapper.module = m  # DDP-style wrapping is looked through
    assert has_document_rotary(wrapper)
    other = Model()
    other.rotary_pos_emb = torch.nn.Identity()  # e.g. YaRN / multimodal RoPE: left alone
    use_document_rotary(other)
    assert not has_document_rotary(other)
    with pytest.raises(ValueError, match="one CP rank"):
        pack(torch.ones(2, 4, dtype=torch.long), torch.tensor([4, 4]), cp_size=2, host_cu_seqlens=True, documents=True)
