"""envs/scratchpad.py: the exact verifier, disjoint seeded splits, the long-tail length distribution of
the task's own demonstrations, the warm-start teacher's slip, and malformed answers scored 0."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from envs.scratchpad import (
    ScratchpadParams,
    ScratchpadSuite,
    parse_prompt,
    response_tokens,
    scratchpad,
    size_weights,
    verify,
)
from flashrl.env import Demonstrating, Task
from flashrl.plugins import make_suite, warm_start_overrides


def test_scratchpad_writes_one_line_per_column_then_the_sum() -> None:
    assert scratchpad(347, 85) == "34+8,1,2\n3+,1,32\n+,0,432\n432"
    assert scratchpad(99, 1) == "9+,1,0\n+,1,00\n100"  # a carry left over leads the answer
    assert scratchpad(0, 0) == "+,0,0\n0"
    assert scratchpad(50, 50) == "5+5,0,0\n+,1,00\n100"
    rng = random.Random(0)
    for _ in range(2000):  # every line is the column step of the line before; the last line is the sum
        a, b = rng.randrange(10 ** rng.randint(1, 12)), rng.randrange(10 ** rng.randint(1, 12))
        lines = scratchpad(a, b).split("\n")
        assert int(lines[-1]) == a + b and len(lines) == max(len(str(a)), len(str(b))) + 1


def test_teacher_slip_forgets_the_units_carry_and_goes_on_consistently() -> None:
    assert scratchpad(347, 85, slip_units_carry=True) == "34+8,0,2\n3+,1,22\n+,0,422\n422"
    assert scratchpad(341, 85, slip_units_carry=True) == scratchpad(341, 85)  # no units carry: nothing to forget


@pytest.mark.parametrize(("a", "b"), [(347, 85), (99, 1), (0, 0), (12345678, 987654321)])
def test_verifier_accepts_the_exact_scratchpad_with_or_without_eos(a: int, b: int) -> None:
    text = scratchpad(a, b)
    for action in (text, text + "<eos>", text + "\n", text + "<eos>junk after the end"):
        v = verify(action, a, b)
        assert v.answer_ok and v.scratchpad_ok, action


@pytest.mark.parametrize(
    "action",
    [
        "",
        "<eos>",
        "432",  # the right sum without the scratchpad
        "34+8,1,2\n3+,1,32\n432",  # a line missing
        "34+8,0,2\n3+,1,22\n+,0,422\n422",  # the teacher's slip
        "34+8,1,2\n3+,1,32\n+,0,432\n433",  # consistent lines, wrong sum
        "34+8,1,2\n3+,1,32\n+,0,432\n432\n432",  # a line too many
        " 34+8,1,2\n3+,1,32\n+,0,432\n432",  # a leading space changes a line
        "the answer is 432 " * 20,
        "\x00\n\ud800\n٤٣٢",  # control chars, a lone surrogate, Arabic-Indic digits (isdigit but not ASCII)
        "9" * 10_000,
        "\n" * 300,
    ],
)
def test_verifier_scores_malformed_or_wrong_text_false_without_raising(action: str) -> None:
    assert not verify(action, 347, 85).scratchpad_ok


def test_answer_ok_reads_the_last_line_alone() -> None:
    assert verify("432", 347, 85).answer_ok
    assert verify("scribbles\n 432 <eos>", 347, 85).answer_ok
    assert not verify("432 433", 347, 85).answer_ok
    assert not verify("٤٣٢", 347, 85).answer_ok


async def test_env_rewards_exact_scratchpad_by_default_and_answer_alone_when_asked() -> None:
    suite = ScratchpadSuite(ScratchpadParams(train_size=50), seed=0, eval_size=10)
    task = Task(id="t", prompt="347+85=", answer="432")
    env = suite.make_env()
    assert await env.reset(task) == "347+85="
    res = await env.step(scratchpad(347, 85) + "<eos>")
    assert res.done and res.reward == 1.0 and res.info == {"correct": True, "answer_ok": True, "scratchpad_ok": True}
    res = await env.step("432")
    assert res.reward == 0.0 and res.info == {"correct": False, "answer_ok": True, "scratchpad_ok": False}
    for junk in ("", "banana", "\n\n", "+,0,"):
        assert (await env.step(junk)).reward == 0.0
    lenient = ScratchpadSuite(ScratchpadParams(train_size=50, check_scratchpad=False), seed=0, eval_size=10).make_env()
    await lenient.reset(task)
    assert (await lenient.step("432")).reward == 1.0
    assert (await lenient.step("432 is it")).reward == 0.0


def test_splits_are_disjoint_seeded_and_sized() -> None:
    p = ScratchpadParams(train_size=3000)
    a, b = ScratchpadSuite(p, seed=3, eval_size=400), ScratchpadSuite(p, seed=3, eval_size=400)
    assert a.train_tasks() == b.train_tasks() and a.eval_tasks() == b.eval_tasks()
    other = ScratchpadSuite(p, seed=4, eval_size=400)
    assert a.eval_tasks() != other.eval_tasks() and a.train_tasks() != other.train_tasks()
    assert len(a.train_tasks()) == 3000 and len(a.eval_tasks()) == 400
    train, held = {t.prompt for t in a.train_tasks()}, {t.prompt for t in a.eval_tasks()}
    assert len(train) == 3000 and len(held) == 400 and not train & held
    assert len({t.id for t in list(a.train_tasks()) + list(a.eval_tasks())}) == 3400
    for t in list(a.train_tasks()) + list(a.eval_tasks()):
        x, y = parse_prompt(t.prompt)
        d = t.meta["digits"]
        assert int(t.answer) == x + y and 2 <= d <= 10 and x < 10**d and y < 10**d


def test_a_size_class_too_small_for_its_share_raises_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="train_size.*lower train_size"):
        ScratchpadSuite(ScratchpadParams(train_size=20_000), seed=0, eval_size=400)  # 2 columns: 10**4 problems
    with pytest.raises(ValueError, match="min_digits"):
        ScratchpadSuite(ScratchpadParams(min_digits=5, max_digits=4), seed=0, eval_size=10)


def test_size_distribution_is_the_power_law() -> None:
    assert size_weights(ScratchpadParams(size_exponent=0.0, max_digits=5)) == pytest.approx({2: .25, 3: .25, 4: .25, 5: .25})
    w = size_weights(ScratchpadParams())
    assert sorted(w) == list(range(2, 11)) and abs(sum(w.values()) - 1) < 1e-12
    assert w[2] == pytest.approx(1 / sum(k**-1.8 for k in range(1, 10)))
    assert w[3] == pytest.approx(w[2] / 2**1.8) and w[10] == pytest.approx(w[2] / 9**1.8)
    assert w[2] > 0.55 and w[9] + w[10] > 0.02  # the median problem has 2 columns; the tail holds p99
    counts = Counter(t.meta["digits"] for t in ScratchpadSuite(ScratchpadParams(), seed=0, eval_size=400).train_tasks())
    for d, pd in w.items():  # 5000 draws: within 4 standard deviations of the expected count
        assert abs(counts[d] - 5000 * pd) < 4 * (5000 * pd * (1 - pd)) ** 0.5 + 1, (d, counts[d])


def test_demonstrations_have_the_long_tail_the_task_promises() -> None:
    """p99 / median of the teacher's response lengths (tokens of the char tokenizer, EOS included) >= 8, and
    every response fits the config's rollout.max_new_tokens (224)."""
    suite = ScratchpadSuite(ScratchpadParams(), seed=0, eval_size=400)
    rng = random.Random(0)
    for split in (suite.train_tasks(), suite.eval_tasks()):
        lengths = sorted(len(suite.demonstration(t, rng).turns[0][0]) + 1 for t in split)
        n = len(lengths)
        p50, p99 = lengths[n // 2], lengths[int(0.99 * n)]
        assert p50 == 19 and p99 / p50 >= 9, (p50, p99)
        assert lengths[-1] <= 224
    assert response_tokens(10**10 - 1, 10**10 - 1) == 207 <= 224


def test_teacher_slips_on_about_the_configured_share_of_units_carries() -> None:
    suite = ScratchpadSuite(ScratchpadParams(), seed=0, eval_size=400)
    rng = random.Random(1)
    carry = [t for t in suite.train_tasks() if sum(x % 10 for x in parse_prompt(t.prompt)) >= 10]
    slipped = sum(not verify(suite.demonstration(t, rng).turns[0][0], *parse_prompt(t.prompt)).scratchpad_ok
                  for t in carry)
    assert 0.6 < slipped / len(carry) < 0.7
    exact = ScratchpadSuite(ScratchpadParams(teacher_carry_slip=0.0, train_size=500), seed=0, eval_size=10)
    for t in exact.train_tasks():
        demo = exact.demonstration(t, rng)
        assert demo.prompt == t.prompt and len(demo.turns) == 1 and demo.turns[0][1] == ""
        assert verify(demo.turns[0][0], *parse_prompt(t.prompt)).scratchpad_ok


def test_registered_as_a_builtin_that_demonstrates() -> None:
    suite = make_suite("scratchpad", {"max_digits": 6, "train_size": 100}, seed=0, eval_size=20)
    assert isinstance(suite, ScratchpadSuite) and isinstance(suite, Demonstrating)
    assert max(t.meta["digits"] for t in suite.train_tasks()) <= 6
    assert warm_start_overrides("scratchpad", {}) == ScratchpadSuite.WARM_START
