"""DecodeGraphs' bookkeeping without a GPU: which buckets get a cascade graph, and which graph a step replays
(the graphs and the model are stubs; the captured kernels are tested on the GPU in tests/gpu)."""

from __future__ import annotations

import torch

from kvfit.runner.cuda_graphs import DecodeGraphs


class _Graph:
    def __init__(self, graphs, name):
        self.graphs, self.name = graphs, name

    def replay(self):
        # what the captured kernels would read: the static prefix length at replay time
        self.graphs.replayed.append((self.name, int(self.graphs.prefix_len.item())))


class _Model:
    def compute_logits(self, hidden):
        return hidden


def _graphs(cascade_tokens):
    graphs = DecodeGraphs(_Model(), [], max_num_seqs=64, max_blocks_per_seq=4, max_model_len=64,
                          device=torch.device("cpu"), cascade_tokens=cascade_tokens)
    graphs.replayed = []
    for b in graphs.buckets:                    # what capture() would leave
        graphs.graphs[b] = _Graph(graphs, ("plain", b))
        graphs.hidden[b, False] = torch.zeros(b, 3)
        if b in graphs.cascade_buckets:
            graphs.cascade_graphs[b] = _Graph(graphs, ("cascade", b))
            graphs.hidden[b, True] = torch.ones(b, 3)
    return graphs


def _step(graphs, batch, prefix_len=None):
    ids = torch.zeros(batch, dtype=torch.int64)
    seq_lens, tables = torch.ones(batch, dtype=torch.int32), torch.zeros((batch, 2), dtype=torch.int32)
    return graphs.replay(ids, ids, ids, seq_lens, tables, prefix_len)


def test_buckets_the_rule_could_take_get_a_cascade_graph():
    graphs = _graphs(lambda shared, num_seqs: shared if num_seqs >= 16 else 0)
    assert graphs.cascade_buckets == {16, 24, 32, 48, 64}
    assert _graphs(None).cascade_buckets == set()


def test_a_step_with_a_prefix_replays_its_bucket_cascade_graph_after_setting_the_length():
    graphs = _graphs(lambda shared, num_seqs: shared if num_seqs >= 16 else 0)
    logits = _step(graphs, 20, torch.tensor([48], dtype=torch.int32))
    assert graphs.replayed == [(("cascade", 24), 48)] and logits.shape == (20, 3) and bool(logits.all())
    logits = _step(graphs, 20)                                    # no prefix: the plain graph
    assert graphs.replayed[-1][0] == ("plain", 24) and not logits.any()
    _step(graphs, 5, torch.tensor([32], dtype=torch.int32))       # no cascade graph in that bucket: plain
    assert graphs.replayed[-1][0] == ("plain", 8)
    graphs.release()
    assert not graphs.graphs and not graphs.cascade_graphs
