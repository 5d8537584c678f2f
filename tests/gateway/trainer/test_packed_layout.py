"""`Batch.to_tensors(layout="packed")`: a session's tree of samples (a trunk, a retry of its last turn, an edit, a
root, a branch of the edit) packed into one row, checked token by token; the refusal of inconsistent trees; and the
tiny dense model's per-token log-probabilities, equal in the row and the packed layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from gateway.sample_tree import joined
from gateway.trainer import Batch
from gateway.trajectory import Sample, SessionMeta, Trajectory, TrajectoryFormatError

torch = pytest.importorskip("torch")


def _sample(
    prompt: list[int],
    response: list[int],
    loss: list[int],
    *,
    version: int = 0,
    parent: int | None = None,
    branch_point: int = 0,
    retry: bool = False,
    experts: int | None = None,
) -> Sample:
    """Model tokens (`loss` 1) have logprob -id/100 and `version`; `experts`: one layer, top-1, coded
    `experts + position` so that where a packed routing came from shows."""
    ids, mask = np.array(response, np.int32), np.array(loss, np.uint8)
    routed = None
    if experts is not None:
        routed = (experts + np.arange(len(prompt) + len(response) - 1)).reshape(-1, 1, 1).astype(np.int64)
    return Sample(
        prompt_ids=np.array(prompt, np.int32),
        response_ids=ids,
        loss_mask=mask,
        logprobs=np.where(mask == 1, -ids / 100, 0.0).astype(np.float32),
        versions=np.where(mask == 1, version, -1).astype(np.int32),
        routed_experts=routed,
        parent=parent,
        branch_point=branch_point,
        retry=retry,
    )


def _trajectory(name: str, samples: list[Sample], rewards: list[float]) -> Trajectory:
    meta = SessionMeta(id=name, status="finished", rewards=rewards, sample_count=len(samples))
    return Trajectory(meta=meta, samples=samples)


def _tree(experts: bool = False) -> Trajectory:
    """Sample 0 the trunk (a reply, a tool result, a reply); 1 retries its last turn (prompted with the ids up to
    that reply; 0 is superseded); 2 edits the user message after [1, 2]; 3 is a root; 4 branches from 2."""
    code = 100 if experts else None

    def routing(k: int) -> int | None:
        return None if code is None else code * k

    samples = [
        _sample([1, 2, 3], [10, 11, 20, 12, 13], [1, 1, 0, 1, 1], version=1, experts=routing(1)),
        _sample([1, 2, 3, 10, 11, 20], [14, 15], [1, 1], version=2, parent=0, branch_point=6, experts=routing(2)),
        _sample([1, 2, 4, 5], [16], [1], version=3, parent=0, branch_point=2, experts=routing(3)),
        _sample([7, 8], [17, 18], [1, 1], version=4, experts=routing(4)),
        _sample([1, 2, 4, 5, 16, 21], [19], [1], version=5, parent=2, branch_point=5, experts=routing(5)),
    ]
    samples[1].retry = samples[0].superseded = True  # as `gateway.sample_tree.joined` delivers a retry
    return _trajectory("tree", samples, [0.1, 0.2, 0.3, 0.4, 0.5])


def _single(experts: bool = False) -> Trajectory:
    return _trajectory("single", [_sample([1], [30, 31], [1, 1], version=6, experts=600 if experts else None)], [1.0])


def test_the_packed_layout_holds_each_shared_token_once_and_attends_within_each_sequence() -> None:
    tree, single = _tree(), _single()
    on_policy = [[np.ones(s.response_ids.size, np.uint8) for s in t.samples] for t in (tree, single)]
    on_policy[0][1] = np.array([0, 1], np.uint8)  # the retry's first token is off-policy
    batch = Batch(trajectories=[tree, single], off_policy_mask=on_policy, group_index=[0, 1])
    t = batch.to_tensors(pad_token_id=-7, layout="packed")

    width, pad = 19, 16
    assert t["input_ids"].shape == t["position_ids"].shape == t["loss_mask"].shape == (2, width)
    assert t["tree_attention_mask"].shape == (2, width, width) and t["tree_attention_mask"].dtype == torch.bool
    assert t["input_ids"].tolist() == [
        [1, 2, 3, 10, 11, 20, 12, 13, 14, 15, 4, 5, 16, 7, 8, 17, 18, 21, 19],
        [1, 30, 31] + [-7] * pad,
    ]
    assert t["attention_mask"].tolist() == [[1] * width, [1] * 3 + [0] * pad]
    assert t["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 2, 3, 4, 0, 1, 2, 3, 5, 6],
        [0, 1, 2] + [0] * pad,
    ]
    assert t["prev_index"].tolist() == [
        [-1, 0, 1, 2, 3, 4, 5, 6, 5, 8, 1, 10, 11, -1, 13, 14, 15, 12, 17],
        [-1, 0, 1] + [-1] * pad,
    ]
    assert t["token_sample"].tolist() == [
        [0] * 8 + [1] * 2 + [2] * 3 + [3] * 4 + [4] * 2,
        [5] * 3 + [-1] * pad,
    ]
    assert t["loss_mask"].tolist() == [
        [0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 1, 1, 0, 1],
        [0, 1, 1] + [0] * pad,
    ]
    assert t["versions"].tolist() == [
        [-1, -1, -1, 1, 1, -1, 1, 1, 2, 2, -1, -1, 3, -1, -1, 4, 4, -1, 5],
        [-1, 6, 6] + [-1] * pad,
    ]
    sampled = [(0, 3, 10), (0, 4, 11), (0, 6, 12), (0, 7, 13), (0, 8, 14), (0, 9, 15), (0, 12, 16), (0, 15, 17)]
    sampled += [(0, 16, 18), (0, 18, 19), (1, 1, 30), (1, 2, 31)]
    expected_logprobs = np.zeros((2, width), np.float32)
    for row, i, token in sampled:
        expected_logprobs[row, i] = -token / 100
    assert np.array_equal(t["old_logprobs"].numpy(), expected_logprobs)

    trunk = set(range(6))  # [1, 2, 3, 10, 11, 20]: the trunk's ids before its last reply
    attends = [{*range(i + 1)} for i in range(8)]  # the trunk
    attends += [trunk | {8}, trunk | {8, 9}]  # the retry: the trunk up to its last reply, not the reply itself
    attends += [{0, 1, 10}, {0, 1, 10, 11}, {0, 1, 10, 11, 12}]  # the edit: the trunk's [1, 2], then its own
    attends += [{*range(13, i + 1)} for i in range(13, 17)]  # the root: nothing of the others
    attends += [{0, 1, 10, 11, 12, 17}, {0, 1, 10, 11, 12, 17, 18}]  # the edit's branch: [1, 2], the edit, its own
    single_attends = [{0}, {0, 1}, {0, 1, 2}] + [{i} for i in range(3, width)]  # padding attends only itself
    mask = t["tree_attention_mask"].numpy()
    assert [set(np.flatnonzero(mask[0, i]).tolist()) for i in range(width)] == attends
    assert [set(np.flatnonzero(mask[1, i]).tolist()) for i in range(width)] == single_attends

    # One per sample (leaf), as in the row layout.
    assert t["rewards"].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 1.0])
    assert t["trajectory_index"].tolist() == [0, 0, 0, 0, 0, 1]
    assert t["sample_index"].tolist() == [0, 1, 2, 3, 4, 0]
    assert t["group_index"].tolist() == [0, 0, 0, 0, 0, 1]
    assert "routed_experts" not in t


def test_the_packed_layout_trains_the_tokens_the_row_layout_trains() -> None:
    batch = Batch(trajectories=[_tree(), _single()])
    rows, packed = batch.to_tensors(layout="rows"), batch.to_tensors(layout="packed")
    assert rows["loss_mask"].sum() == packed["loss_mask"].sum() == 12
    real = packed["token_sample"] >= 0
    sample, position = packed["token_sample"][real], packed["position_ids"][real]
    for name in ("input_ids", "loss_mask", "old_logprobs", "versions"):
        assert torch.equal(rows[name][sample, position], packed[name][real]), name
    for name in ("rewards", "trajectory_index", "sample_index", "group_index"):
        assert torch.equal(rows[name], packed[name]), name
    assert torch.equal(batch.to_tensors()["input_ids"], rows["input_ids"])  # rows is the default


def test_packed_routed_experts_come_from_the_sample_that_holds_each_token() -> None:
    t = Batch(trajectories=[_tree(experts=True), _single(experts=True)]).to_tensors(layout="packed")
    assert t["routed_experts"].shape == (2, 19, 1, 1)
    # The trunk has a routing for its positions 0-6; its last token (7) none, and no branch continues it. The
    # retry's own 6 comes from it; its last token has none. The edit's own 2, 3 are its own; its last token (12)
    # only the edit's branch continues, which recorded it (504). The root's 0-2, the branch's own 5.
    holders = [100, 101, 102, 103, 104, 105, 106, 0, 206, 0, 302, 303, 504, 400, 401, 402, 0, 505, 0]
    assert t["routed_experts"][..., 0, 0].tolist() == [holders, [600, 601] + [0] * 17]


def test_packed_refuses_routed_experts_of_the_wrong_shape() -> None:
    tree = _tree(experts=True)
    tree.samples[2].routed_experts = np.zeros((2, 1, 1), np.int64)
    with pytest.raises(TrajectoryFormatError, match="sample 2: routed experts of shape"):
        Batch(trajectories=[tree]).to_tensors(layout="packed")


def _parent_later(tree: Trajectory) -> None:
    tree.samples[1].parent = 3


def _parent_itself(tree: Trajectory) -> None:
    tree.samples[2].parent = 2


def _past_the_parent(tree: Trajectory) -> None:
    tree.samples[4].prompt_ids = np.array([1, 2, 4, 5, 16, 21, 22], np.int32)
    tree.samples[4].branch_point = 6  # the edit has 5 ids


def _past_its_prompt(tree: Trajectory) -> None:
    tree.samples[1].branch_point = 7  # its prompt has 6 ids; its first reply token would be the trunk's


def _ids_differ(tree: Trajectory) -> None:
    tree.samples[2].prompt_ids = np.array([1, 9, 4, 5], np.int32)


def _a_root_with_a_branch_point(tree: Trajectory) -> None:
    tree.samples[3].branch_point = 1


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_parent_later, "sample 1: its parent 3 is not an earlier sample"),
        (_parent_itself, "sample 2: its parent 2 is not an earlier sample"),
        (_past_the_parent, "sample 4: branch point 6 is past"),
        (_past_its_prompt, "sample 1: branch point 7 is past"),
        (_ids_differ, "sample 2: its first 2 ids differ from its parent 0's"),
        (_a_root_with_a_branch_point, "sample 3: a root with branch point 1"),
    ],
)
def test_packed_refuses_an_inconsistent_tree(corrupt: Callable[[Trajectory], None], message: str) -> None:
    tree = _tree()
    corrupt(tree)
    batch = Batch(trajectories=[tree])
    with pytest.raises(TrajectoryFormatError, match=message):
        batch.to_tensors(layout="packed")
    batch.to_tensors(layout="rows")  # the row layout does not read the tree


def _as_redis_returns(fields: dict[str, bytes | int | str]) -> dict[bytes, bytes]:
    return {name.encode(): value if isinstance(value, bytes) else str(value).encode() for name, value in fields.items()}


def test_a_tree_read_back_from_its_stored_hashes_packs_the_same() -> None:
    """What the consumer delivers: each branch's hash holds its prompt from its branch point on, and `joined` makes
    it whole again."""
    tree = _tree(experts=True)
    stored = {index: Sample.from_redis(_as_redis_returns(s.to_redis())) for index, s in enumerate(tree.samples)}
    assert stored[4].prompt_ids.tolist() == [21]  # the shared ids are the parents'
    read = _trajectory("tree", joined(stored), [0.1, 0.2, 0.3, 0.4, 0.5])
    assert [s.superseded for s in read.samples] == [True, False, False, False, False]
    want, got = (Batch(trajectories=[t]).to_tensors(layout="packed") for t in (tree, read))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[name], got[name]) for name in want)


def test_to_tensors_refuses_an_unknown_layout() -> None:
    with pytest.raises(ValueError, match="layout must be"):
        Batch(trajectories=[_single()]).to_tensors(layout="flat")  # type: ignore[arg-type]


def test_an_empty_batch_packs_to_empty_tensors() -> None:
    t = Batch().to_tensors(layout="packed")
    assert t["input_ids"].shape == (0, 0) and t["tree_attention_mask"].shape == (0, 0, 0)
    assert t["rewards"].shape == (0,)


# --- the tiny model: per-token log-probabilities equal in both layouts ---


def _random_tree(rng: np.random.Generator) -> Trajectory:
    """`_tree`'s shape with longer sequences of random ids of the tiny model's vocabulary (2048)."""

    def ids(n: int) -> list[int]:
        return rng.integers(3, 2048, n).tolist()

    prompt, reply, tool, last = ids(9), ids(6), ids(5), ids(7)
    before_last = prompt + reply + tool
    edit = prompt[:4] + ids(6)
    edit_reply = ids(5) + ids(3) + ids(4)
    nested = edit + edit_reply[:5] + ids(4)
    samples = [
        _sample(prompt, reply + tool + last, [1] * 6 + [0] * 5 + [1] * 7, version=1),
        _sample(before_last, ids(8), [1] * 8, version=2, parent=0, branch_point=len(before_last), retry=True),
        _sample(edit, edit_reply, [1] * 5 + [0] * 3 + [1] * 4, version=3, parent=0, branch_point=4),
        _sample(ids(7), ids(6), [1] * 6, version=4),
        _sample(nested, ids(6), [1] * 6, version=5, parent=2, branch_point=len(edit) + 5),
    ]
    return _trajectory("random-tree", samples, [0.0] * len(samples))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tiers' `dense` model (scripts/build_tiny_models.py: Qwen2, vocab 2048), built here in a second."""
    from benchmarks.mismatch import build_model

    return build_model(tmp_path_factory.mktemp("models"), "float32")


def _next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Token `i`'s log-probability under the logits at `prev[i]` (0 where `prev` is -1)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(input_ids.shape[0])[:, None]
    picked = logprobs[rows, prev.clamp(min=0)].gather(-1, input_ids.clamp(min=0)[..., None]).squeeze(-1)
    return torch.where(prev >= 0, picked, torch.zeros_like(picked))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_tiny_models_logprobs_are_equal_in_both_layouts(tiny_model: Path, attention: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attention)
    model.eval()
    rng = np.random.default_rng(7)
    batch = Batch(trajectories=[_random_tree(rng), _single()])
    rows, packed = batch.to_tensors(layout="rows"), batch.to_tensors(layout="packed")

    width = rows["input_ids"].shape[1]
    previous = torch.arange(width).expand_as(rows["input_ids"]) - 1
    with torch.no_grad():
        logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    by_row = _next_token_logprobs(logits, rows["input_ids"], previous)

    def packed_logprobs(allowed: torch.Tensor) -> torch.Tensor:
        # A custom 4D mask (batch, 1, query, key), additive: transformers' mask preparation returns a 4D mask as it
        # is (masking_utils: "It can also be an already prepared 4D mask"), and the attention adds it.
        additive = torch.where(allowed[:, None], 0.0, torch.finfo(torch.float32).min)
        with torch.no_grad():
            out = model(input_ids=packed["input_ids"], attention_mask=additive, position_ids=packed["position_ids"])
        return _next_token_logprobs(out.logits, packed["input_ids"], packed["prev_index"])

    sampled = packed["loss_mask"] > 0
    sample, position = packed["token_sample"][sampled], packed["position_ids"][sampled]
    assert int(sampled.sum()) == int(rows["loss_mask"].sum()) == 44
    difference = (packed_logprobs(packed["tree_attention_mask"])[sampled] - by_row[sample, position]).abs().max()
    print(f"{attention}: max |packed - rows| logprob over {int(sampled.sum())} sampled tokens: {difference:.3g}")
    assert difference < 1e-4

    # Every token with a predecessor, shared prefixes included, agrees too.
    real = packed["prev_index"] >= 0
    everywhere = packed_logprobs(packed["tree_attention_mask"])[real]
    expected = by_row[packed["token_sample"][real], packed["position_ids"][real]]
    assert torch.allclose(everywhere, expected, atol=1e-4)

    # The check can fail: a packed row under a plain causal mask lets each branch see its earlier siblings.
    real_tokens = packed["attention_mask"].bool()
    packed_width = packed["input_ids"].shape[1]
    causal = torch.tril(torch.ones(packed_width, packed_width, dtype=torch.bool))
    siblings_seen = (causal & real_tokens[:, None, :]) | torch.eye(packed_width, dtype=torch.bool)
    wrong = (packed_logprobs(siblings_seen)[sampled] - by_row[sample, position]).abs().max()
    assert wrong > 1e-2
