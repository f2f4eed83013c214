"""Stand-ins for the engine, the trainer, the environment and the tokenizer, and virtual time.

Three families, one per purpose; each has a member for every role the controller talks to, and
the members of one family are meant to be used together:

    role        Fake* (fake.py)            Sim* (engine, trainer, envs)     Instant* (instant.py)
    ----------  -------------------------  -------------------------------  -----------------------
    engine      FakeEngine                 SimEngine                        InstantEngine
    trainer     FakeTrainer                SimTrainer                       InstantTrainer
    env suite   FakeSuite / FakeEnv        SimSuite / SimEnv (env "sim")    InstantSuite / InstantEnv
    tokenizer   FakeTokenizer              SimTokenizer                     SimTokenizer(cache=True)
    ----------  -------------------------  -------------------------------  -----------------------
    use it for  unit tests of the          the bench's simulator: how long  the overhead bench: what
                controller, rollout,       a run takes at scale, from       the controller itself
                checkpoints: every         latency models (continuous       costs per sample (the
                duration, failure, death   batching, step time, weight      parts answer at once and
                and hang is scripted, so   sync, env delays and faults);    model no time, so every
                a test asserts exact       deterministic from the seed      CPU second is the
                times and token layouts                                     controller's)

    virtual time (clock.py): run_virtual(main) -> VirtualRun(result, virtual_s, cpu_s) runs main()
    on an event loop whose clock jumps to the next timer; the Fake and Sim families run on it (the
    Instant family never waits, so it runs on a plain loop).

Pick by the question: "does the controller do the right thing?" -> Fake; "how fast would this
configuration run on N GPUs?" -> Sim; "how much CPU does the controller spend per sample?" ->
Instant. Tests of one test file that need a stand-in for something else (a clock, an LLM object)
keep it local to that file.
"""
