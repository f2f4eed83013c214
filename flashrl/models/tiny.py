"""The built-in tiny model: a random-init Llama-architecture causal LM with the char-level tokenizer.

``build_untrained`` writes a Hugging Face model folder (config.json, model.safetensors,
generation_config.json, tokenizer files) that loads both in transformers and in vLLM
(``LLM(model=path, dtype="float32", enforce_eager=True)``), offline. The warm-start that turns it into
a useful RL starting point is ``ensure_model`` in ``flashrl/models/__init__.py``.

Why Llama and not Qwen2 (the same decoder, without q/k/v biases): transformers 5 (and vLLM, which calls
``AutoTokenizer`` through ``CachedHfTokenizer``) force ``model_type == "qwen2"`` folders onto
``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the vocabulary and ignores our tokenizer.json
(spaces and newlines vanish: "12 + 3=\n4" decodes as "12+3=4"). ``"tokenizer_class":
"PreTrainedTokenizerFast"`` in tokenizer_config.json and/or config.json does not help: "qwen2" is in
transformers' ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``, so ``AutoTokenizer`` replaces any hub class
with the registered ``Qwen2Tokenizer`` (checked with transformers 5.19; vLLM 0.32's own override list,
``_MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS``, does not name qwen2). For ``llama`` folders
``AutoTokenizer`` honours tokenizer.json. head_dim must be one vLLM's CPU attention
supports (32, 64, 80, ...), which ``TinySpec`` checks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from flashrl.env import Demonstrating, states_integer
from flashrl.models.progress import Phase, Progress
from flashrl.models.tokenizer import BOS, EOS, PAD, build_char_tokenizer

# vLLM CPU attention head sizes (vllm/v1/attention/backends/cpu_attn.py).
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class TinySpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Shape of the built-in model (a Llama decoder)."""

    layers: Annotated[int, Meta(ge=1, le=64, description="decoder layers")] = 2
    hidden: Annotated[int, Meta(ge=32, le=8192, description="hidden size")] = 128
    heads: Annotated[int, Meta(ge=1, le=128, description="attention heads")] = 4
    kv_heads: Annotated[int, Meta(ge=1, le=128, description="key/value heads (GQA)")] = 2
    intermediate: Annotated[int, Meta(ge=16, le=65536, description="MLP inner size")] = 512
    max_position: Annotated[int, Meta(ge=16, le=1 << 20, description="max positions (prompt + response)")] = 256

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"TinySpec: hidden={self.hidden} must be a multiple of heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"TinySpec: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.hidden // self.heads not in _CPU_HEAD_SIZES:
            raise ValueError(f"TinySpec: head size hidden/heads={self.hidden // self.heads} is not one vLLM's CPU "
                             f"attention supports {_CPU_HEAD_SIZES}; change hidden or heads")


def build_untrained(path: str | Path, seed: int = 0, spec: TinySpec | None = None) -> Path:
    """Save a random-init (seeded) float32 LlamaForCausalLM + char tokenizer to ``path``; return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinySpec()
    return save_char_model(path, seed, LlamaConfig, LlamaForCausalLM, hidden_size=spec.hidden,
                           intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
                           num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                           max_position_embeddings=spec.max_position)


def save_char_model(path: str | Path, seed: int, config_cls: Any, model_cls: Any, **shape: Any) -> Path:
    """Save a random-init (seeded) float32 ``model_cls`` of ``config_cls(**shape)`` with the built-in char
    tokenizer (its vocabulary, pad / bos / eos ids, tied embeddings, rope theta 1e4) to ``path``; return it.
    builtin:tiny's and builtin:moe's (flashrl/models/moe.py) build."""
    import torch
    from transformers import GenerationConfig

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    config: Any = config_cls(  # rope_theta, torch_dtype: accepted as **kwargs
        vocab_size=len(tok),  # exactly the tokenizer: no id the tokenizer cannot decode can be sampled
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tok.convert_tokens_to_ids(PAD),
        bos_token_id=tok.convert_tokens_to_ids(BOS),
        eos_token_id=tok.convert_tokens_to_ids(EOS),
        torch_dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    model: Any = model_cls(config)
    model = model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


# --------------------------------------------------------------------------- torch helpers
# Used by the warm-start below. For answers of a few tokens generation recomputes the whole (left-padded)
# prefix each step instead of keeping a KV cache: simpler, and on this model size not slower. Past
# ``_CACHE_FROM`` new tokens (the scratchpad task's responses run to ~200) the O(T^2) recompute made one
# 128-problem probe take minutes, so ``generate`` keeps a KV cache there; the threshold keeps the short
# tasks' builds (arithmetic, guess, countdown) on the exact code path they were built with.
_CACHE_FROM = 32


class WarmStart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Supervised warm-start of the built-in model on the env's train split (prompt -> answer + EOS).

    Training stops at ``max_steps`` or as soon as greedy accuracy on ``probe_size`` train problems
    reaches ``target_accuracy`` (a safety valve): the point is a policy that is right sometimes (so GRPO
    groups carry signal) but far from perfect (so RL has room to show). Default: constant lr, a teacher
    that slips on 65% of carries, stop at 50% probe accuracy (2-digit addition, seeds 0/1: 2100/1450
    steps, held-out 50%/53%; 200-280 s on a loaded 2-core machine with two builds at once). With an
    exact teacher and a 25% stop, RL gained only ~10 points in 200 steps (the model lacked the skill);
    with this teacher a one-process GRPO experiment (bench/feasibility_grpo.py, retired; in git at 4889669) gained +31 (seed 0) and +16 (seed 1) in 200 steps
    (lr 1e-4, 8x16, T 0.7, 2 mini-batches). An lr decayed to 0 gives a more settled policy, but GRPO then degraded it in that experiment, so it is off. The probe
    is 512 problems: with 128 the stop point was noisy enough that two seeds started RL at 20% and 40%
    held-out accuracy.

    ``min_steps``: the probe may cross ``target_accuracy`` in the middle of the sharp rise of the SFT
    curve, long before the policy has settled. Arithmetic seed 1 did (issue 12): probe 36% at step 700,
    51% at 750 -> stopped, held-out 44.8%, and RL then plateaued at a noisy 50-70% (flashrl and TRL
    alike); the same seed trained to 1500 steps starts RL at 57.3% held-out and reaches 87-90%. Seeds 0
    and 2 stop at 1650 and 2200 steps anyway. The arithmetic suite sets ``min_steps = 1500``
    (``ArithmeticSuite.WARM_START``); the default 0 keeps the plain early stop for other environments.

    ``teacher_carry_slip`` (an imperfect teacher, common in practice): the SFT targets come from a
    teacher that forgets the units carry of an addition with probability p (``teacher_answers``), so a
    well-imitating model answers carry problems wrong greedily but right in a 1-p fraction of samples;
    RL with the exact verifier then has dense signal to correct it. The probe and the reported
    accuracies always score against the exact answers.
    """

    max_steps: Annotated[int, Meta(ge=0, description="most optimizer steps")] = 4000
    batch: Annotated[int, Meta(ge=1, description="sequences per step")] = 64
    lr: Annotated[float, Meta(gt=0, description="AdamW peak learning rate")] = 1e-3
    warmup: Annotated[int, Meta(ge=0, description="linear lr warm-up steps")] = 0
    decay: Annotated[bool, Meta(description="decay the lr linearly to 0 at max_steps (a settled policy; tried: RL then degraded it)")] = False
    target_accuracy: Annotated[float, Meta(ge=0, le=1, description="stop once probe accuracy reaches this")] = 0.5
    min_steps: Annotated[int, Meta(ge=0, description="never stop before this many steps (target_accuracy is checked from here on)")] = 0
    check_every: Annotated[int, Meta(ge=1, description="steps between probe evaluations")] = 50
    probe_size: Annotated[int, Meta(ge=1, description="train problems in the probe")] = 512
    # The warm-start imitates an imperfect teacher; RL with the exact verifier corrects it.
    teacher_carry_slip: Annotated[float, Meta(ge=0, le=1, description=(
        "chance the SFT teacher forgets the units carry on an addition that has one (answer a+b-10 instead of "
        "a+b), drawn afresh each time the problem is drawn; 0 = an exact teacher"))] = 0.65


def left_pad(seqs: list[list[int]], pad_id: int):  # -> (input_ids, attention_mask, position_ids)
    """Left-pad token lists into tensors (generation appends on the right)."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def generate(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int,
             temperature: float = 0.0, generator=None) -> list[list[int]]:
    """Sample (temperature > 0) or greedy-decode continuations; each stops after its EOS (included)."""
    import torch

    ids, mask, pos = left_pad(prompts, pad_id)
    out: list[list[int]] = [[] for _ in prompts]
    alive = torch.ones(len(prompts), dtype=torch.bool)
    cached = max_new_tokens > _CACHE_FROM
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            if cached:  # forward only the new token against the keys/values of the ones before
                fresh = ids if past is None else ids[:, -1:]
                res = model(input_ids=fresh, attention_mask=mask, position_ids=pos[:, -fresh.shape[1]:],
                            past_key_values=past, use_cache=True)
                past, logits = res.past_key_values, res.logits[:, -1, :]
            else:
                logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1, :]
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            else:
                nxt = logits.argmax(-1)
            nxt = torch.where(alive, nxt, torch.full_like(nxt, pad_id))
            for i in torch.nonzero(alive).flatten().tolist():
                out[i].append(int(nxt[i]))
            alive &= nxt != eos_id
            if not alive.any():
                break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, alive[:, None].long() | (nxt[:, None] == eos_id).long()], dim=1)
            pos = torch.cat([pos, pos[:, -1:] + 1], dim=1)
    return out


def greedy_accuracy(model, tok, tasks, max_new_tokens: int, batch: int = 256, phase: Phase | None = None) -> float:
    """Fraction of ``tasks`` whose greedy answer states the task's integer answer (flashrl.env.states_integer,
    the arithmetic env's verifier). ``phase``: advanced by each task scored, with the accuracy so far."""
    if not tasks:
        return 0.0
    correct = 0
    for start in range(0, len(tasks), batch):
        chunk = tasks[start:start + batch]
        outs = generate(model, [tok.encode(t.prompt) for t in chunk], max_new_tokens, tok.eos_token_id, tok.pad_token_id)
        correct += sum(states_integer(tok.decode(o), t.answer) for o, t in zip(outs, chunk))
        if phase is not None:
            phase.advance(len(chunk), accuracy=correct / (start + len(chunk)))
    return correct / len(tasks)


def answer_tokens(tasks) -> int:
    """Longest answer + EOS over ``tasks``: the max_new_tokens that can fit every answer."""
    return max(len(t.answer) for t in tasks) + 1


def sft_batch(tok, tasks):  # -> (input_ids, attention_mask, labels)
    """Right-padded prompt+answer+EOS with labels only on answer and EOS tokens."""
    seqs, labels = [], []
    for t in tasks:
        p, a = tok.encode(t.prompt), tok.encode(t.answer) + [tok.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    return right_pad(seqs, labels, tok.pad_token_id)


def right_pad(seqs: list[list[int]], labels: list[list[int]], pad_id: int):  # -> (input_ids, attention_mask, labels)
    """Right-pad token lists and their labels (-100 where no loss) into tensors for a supervised step."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels)):
        ids[i, :len(s)] = torch.tensor(s)
        lab[i, :len(s)] = torch.tensor(lb)
        mask[i, :len(s)] = 1
    return ids, mask, lab


_ADD_RE = re.compile(r"(\d+)\+(\d+)=")


def carry_slip_answer(prompt: str) -> str | None:
    """The answer of a student who forgets the carry out of the units column, or None if nothing to forget.

    Only for addition prompts "a+b=" whose units digits sum to 10 or more: the slipped answer is
    a + b - 10 ("17+25=" -> "32", not 42; "57+68=" -> "115", not 125). The imperfect teacher of the
    warm-start (``WarmStart.teacher_carry_slip``); the environment's verifier stays exact.
    """
    m = _ADD_RE.fullmatch(prompt)
    if m is None:
        return None
    a, b = int(m.group(1)), int(m.group(2))
    if a % 10 + b % 10 < 10:
        return None
    return str(a + b - 10)


def teacher_answers(tasks, slip: float, rng) -> list:
    """``tasks`` as an imperfect teacher answers them: each addition with a units carry gets the
    carry-forgotten answer (``carry_slip_answer``) with probability ``slip``.

    One ``rng.random()`` per task that has a carry, so the result is deterministic for the rng's state.
    """
    out = []
    for t in tasks:
        wrong = carry_slip_answer(t.prompt)
        if wrong is not None and rng.random() < slip:
            t = msgspec.structs.replace(t, answer=wrong)
        out.append(t)
    return out


# A demonstration batch wider than this is split into length-sorted micro-batches (``demo_batches``): the
# scratchpad task's batches mix ~20-token responses with ~200-token ones, and one right-padded batch spent
# ~5x its real tokens on padding. Narrower batches (every other demonstrating task) stay one batch, on the
# exact code path they were built with.
_PACK_FROM = 64
_PACK_TOKENS = 1024  # padded tokens per micro-batch


def batch_loss(model, batch):
    """The supervised loss of ``batch``: one (input_ids, attention_mask, labels), or a list of them (micro-batches
    of one batch), then the mean over all their label tokens, as one batch of them would have it."""
    if isinstance(batch, tuple):
        ids, mask, lab = batch
        return model(input_ids=ids, attention_mask=mask, labels=lab).loss
    counts = [int((lab[:, 1:] != -100).sum()) for _, _, lab in batch]  # the causal LM loss's shifted labels
    total = sum(counts)
    return sum(model(input_ids=ids, attention_mask=mask, labels=lab).loss * (n / total)
               for (ids, mask, lab), n in zip(batch, counts))


def demo_batches(tok, demos):  # -> (input_ids, attention_mask, labels) or a list of them
    """``demo_batch``, split into length-sorted micro-batches of at most ``_PACK_TOKENS`` padded tokens when
    the one batch would be wider than ``_PACK_FROM`` (``batch_loss`` weighs them back into one batch's loss)."""
    lengths = [len(tok.encode(d.prompt)) + sum(len(tok.encode(a)) + 1 + len(tok.encode(o)) for a, o in d.turns)
               for d in demos]
    if max(lengths) <= _PACK_FROM:
        return demo_batch(tok, demos)
    order = sorted(range(len(demos)), key=lambda i: -lengths[i])
    parts: list[list[int]] = []
    for i in order:  # longest first: a micro-batch's width is its first member's length
        if parts and (len(parts[-1]) + 1) * lengths[parts[-1][0]] <= _PACK_TOKENS:
            parts[-1].append(i)
        else:
            parts.append([i])
    return [demo_batch(tok, [demos[i] for i in part]) for part in parts]


def demo_batch(tok, demos):  # -> (input_ids, attention_mask, labels)
    """Right-padded multi-turn teacher episodes (flashrl.env.Demo): labels on every action and the EOS
    closing its turn; the prompt and the observations get none (the rollout's loss mask, exactly)."""
    seqs, labels = [], []
    for d in demos:
        ids = tok.encode(d.prompt)
        lab = [-100] * len(ids)
        for action, obs in d.turns:
            a = tok.encode(action) + [tok.eos_token_id]
            o = tok.encode(obs) if obs else []
            ids += a + o
            lab += a + [-100] * len(o)
        seqs.append(ids)
        labels.append(lab)
    return right_pad(seqs, labels, tok.pad_token_id)


def play_episodes(model, tok, suite, tasks, max_new_tokens: int, max_turns: int, temperature: float = 0.0,
                  generator=None) -> list[tuple[float, bool]]:
    """Play ``tasks`` in ``suite``'s environments with the model (in process, all episodes batched per
    turn), laid out like the controller's rollout: action tokens + EOS, then the observation's tokens.
    Returns (total reward, correct) per task; correct as the controller scores it (info["correct"], else
    reward >= 1)."""
    import asyncio

    async def episodes() -> list[tuple[float, bool]]:
        envs = [suite.make_env() for _ in tasks]
        ctx = [tok.encode(await e.reset(t)) for e, t in zip(envs, tasks)]
        reward, correct = [0.0] * len(tasks), [False] * len(tasks)
        alive = list(range(len(tasks)))
        for _ in range(max_turns):
            if not alive:
                break
            outs = generate(model, [ctx[i] for i in alive], max_new_tokens, tok.eos_token_id, tok.pad_token_id,
                            temperature=temperature, generator=generator)
            still = []
            # All episodes step at once: an env whose calls take time (envs/tools.py's tool latency) costs the
            # slowest call per turn, not the sum of them; each env draws from its own rng, so order is moot.
            results = await asyncio.gather(*(envs[i].step(tok.decode(out)) for i, out in zip(alive, outs)))
            for i, out, res in zip(alive, outs, results):
                ctx[i] = ctx[i] + out
                reward[i] += res.reward
                correct[i] = bool(res.info["correct"]) if "correct" in res.info else reward[i] >= 1.0
                if not res.done:
                    ctx[i] = ctx[i] + tok.encode(res.observation)
                    still.append(i)
            alive = still
        for e in envs:
            await e.close()
        return list(zip(reward, correct))

    return asyncio.run(episodes())


def _sft_loop(model, opt, ws: WarmStart, next_batch, probe, what: str, log, progress: Progress) -> tuple[int, float]:
    """The warm-start's supervised loop: each step trains on ``next_batch()`` (input_ids, attention_mask,
    labels) with the lr warm-up/decay of ``ws`` and gradient clip 1.0; every ``check_every`` steps
    ``probe()`` (greedy) is logged as ``what``, and training stops once it reaches ``target_accuracy``
    at or past ``min_steps``. Returns (steps, last probe value). ``progress``: one phase, a step each."""
    with progress.phase("warm-start", total=ws.max_steps) as phase:
        step, probe_acc = _sft_steps(model, opt, ws, next_batch, probe, what, log, phase)
        phase.finish(step)
    return step, probe_acc


def _sft_steps(model, opt, ws: WarmStart, next_batch, probe, what: str, log, phase: Phase) -> tuple[int, float]:
    import torch

    probe_acc, step = 0.0, 0
    while step < ws.max_steps:
        model.train()
        scale = min(1.0, (step + 1) / ws.warmup) if ws.warmup else 1.0
        if ws.decay:
            scale *= 1.0 - step / ws.max_steps
        for group in opt.param_groups:
            group["lr"] = ws.lr * scale
        loss = batch_loss(model, next_batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        phase.advance(1, loss=loss.item())
        if step % ws.check_every == 0 or step == ws.max_steps:
            model.eval()
            probe_acc = probe()
            phase.note(**{what: probe_acc})
            if log:
                log(f"warm-start step {step}: loss {loss.item():.3f} {what} {probe_acc:.3f}")
            if probe_acc >= ws.target_accuracy and step >= ws.min_steps:
                break
    return step, probe_acc


def _warm_start_demos(model, tok, opt, suite, ws: WarmStart, rng, log, progress: Progress) -> tuple[int, float]:
    """Imitate ``suite.demonstration`` episodes (multi-turn); returns (steps, greedy probe success)."""
    train = list(suite.train_tasks())
    probe = train[: ws.probe_size]
    sample = [suite.demonstration(t, rng) for t in probe]
    max_new = max(len(tok.encode(a)) for d in sample for a, _ in d.turns) + 1
    max_turns = max(len(d.turns) for d in sample)

    def next_batch():
        return demo_batches(tok, [suite.demonstration(t, rng) for t in rng.sample(train, min(ws.batch, len(train)))])

    def success() -> float:
        return sum(c for _, c in play_episodes(model, tok, suite, probe, max_new, max_turns)) / len(probe)

    return _sft_loop(model, opt, ws, next_batch, success, "probe success (greedy)", log, progress)


def load_balancing(model, on: bool) -> None:
    """A Mixture-of-Experts model (builtin:moe) adds its load-balancing loss to the warm-start's (transformers'
    ``output_router_logits``, weighted by ``router_aux_loss_coef``), so that its experts stay in use; saved
    without it (the RL trainer adds none). A dense model: nothing."""
    if getattr(model.config, "router_aux_loss_coef", None) is not None:
        model.config.output_router_logits = on


def warm_start(model_dir: str | Path, train_tasks, eval_tasks, ws: WarmStart, seed: int = 0,
               log=None, suite=None, progress: Progress | None = None, eval_play: tuple[int, int] | None = None) -> dict:
    """Supervised warm-start of the model saved in ``model_dir``, in place; returns its report.

    Deterministic for a seed on one thread (the caller sets torch threads). Report keys: eval_accuracy
    (greedy, on ``eval_tasks``), probe_accuracy, steps, seconds; for a ``suite`` that demonstrates
    (flashrl.env.Demonstrating: multi-turn teacher episodes) also eval_success_sampled and eval_reward_sampled
    (temperature 1, what the RL rollouts start from), and eval_turns / eval_max_new_tokens, how its
    held-out episodes were played: ``eval_play`` (turns, tokens per turn), the RL eval's rollout.max_turns
    and rollout.max_new_tokens (ensure_model passes them), so that the report's numbers are the RL eval's
    at step 0 (greedy or at T = 1); None: sized by the teacher's episodes (its longest action and most
    turns over 64 held-out demonstrations). ``progress``: its phases (load, warm-start, eval).
    """
    import random
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from flashrl.models.tokenizer import load_tokenizer

    progress = progress or Progress.off()
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    with progress.phase("loading the model") as phase:
        tok = load_tokenizer(model_dir)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        load_balancing(model, True)
        phase.note(parameters=sum(p.numel() for p in model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    if isinstance(suite, Demonstrating):
        steps, probe_acc = _warm_start_demos(model, tok, opt, suite, ws, rng, log, progress)
        model.eval()
        eval_tasks = list(suite.eval_tasks())
        # One rng for all 64: a fresh random.Random(seed) per task replays the same draws for every
        # demonstration, so a teacher whose first draw picks its shortest episode (envs/tools.py, seed 1:
        # answer at once) sized the held-out episodes to one turn of 5 tokens and reported 0% success.
        if eval_play is not None:
            max_turns, max_new = eval_play
        else:
            demo_rng = random.Random(seed)
            sample = [suite.demonstration(t, demo_rng) for t in eval_tasks[:64]]
            max_new = max(len(tok.encode(a)) for d in sample for a, _ in d.turns) + 1
            max_turns = max(len(d.turns) for d in sample)
        with progress.phase("held-out episodes, greedy and sampled", unit="episodes") as phase:
            greedy = play_episodes(model, tok, suite, eval_tasks, max_new, max_turns)
            phase.advance(len(eval_tasks), success=sum(c for _, c in greedy) / max(len(eval_tasks), 1))
            gen = torch.Generator().manual_seed(seed)
            sampled = play_episodes(model, tok, suite, eval_tasks, max_new, max_turns, temperature=1.0, generator=gen)
            phase.advance(len(eval_tasks), success_sampled=sum(c for _, c in sampled) / max(len(eval_tasks), 1))
        load_balancing(model, False)
        model.save_pretrained(str(model_dir), safe_serialization=True)
        n = max(len(eval_tasks), 1)
        return {"eval_accuracy": sum(c for _, c in greedy) / n, "probe_accuracy": probe_acc, "steps": steps,
                "eval_success_sampled": sum(c for _, c in sampled) / n,
                "eval_reward_sampled": sum(r for r, _ in sampled) / n,
                "eval_turns": max_turns, "eval_max_new_tokens": max_new,
                "seconds": round(time.perf_counter() - t0, 2)}
    probe = list(train_tasks[: ws.probe_size])
    max_new = answer_tokens(list(train_tasks) + list(eval_tasks))

    def next_batch():
        batch = rng.sample(train_tasks, min(ws.batch, len(train_tasks)))
        if ws.teacher_carry_slip > 0:
            batch = teacher_answers(batch, ws.teacher_carry_slip, rng)
        return sft_batch(tok, batch)

    step, probe_acc = _sft_loop(model, opt, ws, next_batch, lambda: greedy_accuracy(model, tok, probe, max_new),
                                "probe accuracy", log, progress)
    model.eval()
    with progress.phase("held-out accuracy (greedy)", total=len(eval_tasks), unit="problems") as phase:
        eval_acc = greedy_accuracy(model, tok, list(eval_tasks), max_new, phase=phase)
    load_balancing(model, False)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return {"eval_accuracy": eval_acc, "probe_accuracy": probe_acc, "steps": step,
            "seconds": round(time.perf_counter() - t0, 2)}
