"""Drafter training's step: compiled against eager, compiled once whatever the batch length, and
(on CUDA) never waiting for the device."""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from dspark import train as training
from dspark.data import Sequence
from tiny_training import VOCAB, sequences, target, tiny_drafter_config  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_a_compiled_step_computes_the_eager_losses_and_gradients_and_compiles_once(target, sequences, head):
    """COMPILE_MODES "all" (target forward and each drafter's loss compiled with Inductor) against
    "none": same losses, acceptance estimates and gradients, for the drafter and its rank-0 twin, on
    batches of two lengths; the second length compiles nothing new (make_batch pads the length to a
    multiple of LENGTH_MULTIPLE and always makes num_anchors blocks; without that every new length
    compiled the target's forward and both losses again). The rnn head unrolls its state along the
    block inside the compiled loss; its case weighs the slots by their reach (--reach-weights)."""
    config = training.TrainConfig(batch_size=4, num_anchors=6, reach_weights=head == "rnn")
    longer = [Sequence(s.tokens * 3, s.prompt_len) for s in sequences]  # past one LENGTH_MULTIPLE
    results, graphs, lengths = {}, [], set()
    for compile in ("none", "all"):
        torch.manual_seed(0)
        students = [training.make_student("drafter", target, tiny_drafter_config(target, markov_head_type=head),
                                          config),
                    training.make_student("twin", target, tiny_drafter_config(target, markov_rank=0), config)]
        results[compile] = []
        for data in (sequences, longer):
            batch = training.make_batch(data[:config.batch_size], 3, config, students[0].drafter.block_size)
            lengths.add(batch.tokens.shape[1])
            for student, loss, stats, _ in training.student_losses(target, students, batch, config, compile):
                grads = torch.autograd.grad(loss, [p for p in student.drafter.parameters() if p.requires_grad])
                results[compile].append((loss.detach(), stats.accept, stats.reached, *grads))
            if compile == "all":
                graphs.append(counters["stats"]["unique_graphs"])
    assert len(lengths) == 2
    assert graphs[1] == graphs[0]  # the second length reuses the first one's graphs
    for want, got in zip(results["none"], results["all"], strict=True):
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="compile must be one of"):
        next(training.student_losses(target, students, batch, config, "everything"))


@pytest.mark.gpu
def test_a_training_step_on_cuda_never_waits_for_the_device(target, sequences):
    """The batch's copy (from pinned memory) and the step (forward, loss, backward, optimizer, the
    statistics) queue work without a synchronizing call, so the host makes the next batch while the
    device computes; reading the statistics is the wait (the control: it fails under the same mode)."""
    target = copy.deepcopy(target).cuda()
    config = training.TrainConfig(batch_size=4, num_anchors=6, rank0_twin=False)
    students = training.make_students(target, tiny_drafter_config(target), config)
    batch = training.make_batch(sequences[:4], 0, config, 4)
    training.train_step(target, students, batch.to("cuda"), config, "none")  # the first calls set things up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats, _ = training.train_step(target, students, batch.to("cuda"), config, "none")
        with pytest.raises(RuntimeError, match="synchroniz"):
            stats[0].summary()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert stats[0].summary()["loss"] > 0


def test_after_compile_ahead_no_training_step_compiles_again(target, sequences):
    """compile_ahead (run while the data is generated) with throwaway students: the training steps
    of other students, on batches of every length up to its `longest`, compile nothing new. With one
    length (128) ahead, a batch of 704 compiled the drafter's loss again."""
    config = training.TrainConfig(batch_size=4, num_anchors=6, rank0_twin=False)
    drafter_config = tiny_drafter_config(target)
    training.compile_ahead(target, drafter_config, config, longest=700, compile="all")
    graphs = counters["stats"]["unique_graphs"]
    students = training.make_students(target, drafter_config, config)
    generator = torch.Generator().manual_seed(0)
    for step, length in enumerate((690, 300, 130, 512, 641)):
        data = [Sequence(torch.randint(1, VOCAB, (length - 9 * i,), generator=generator).tolist(), 4 + i)
                for i in range(config.batch_size)]
        training.train_step(target, students, training.make_batch(data, step, config, 4), config, "all")
    assert counters["stats"]["unique_graphs"] == graphs
