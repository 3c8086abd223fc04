"""What a comparison's config means: each entry of `config.policies` as a policy plan and engine options, and the
whole config resolved and checked (a ValueError naming the problem) before anything is built or written.
experiments/compare_policies.py runs what this resolves; experiments/capacity.py resolves the same way.
"""

from __future__ import annotations

from absl import logging

from experiments.load_harness import capacity_policy, load_of

# Not engine options: they make a data-parallel engine (cbjax/data_parallel.py) of replicas behind a router.
DATA_PARALLEL_OPTIONS = ("data_parallel_size", "router", "router_options")


def entry_plan(cfg, name: str):
    """The PolicyPlan of one entry of `config.policies`, and the engine options it overrides.

    An entry is a policy name (cbjax.bench.online.plan_policy) or a label of `config.variants`, whose value names the
    policy and overrides engine options: variants.cache_on = dict(policy="fcfs", enable_prefix_caching=True).
    `config.policy_options[entry]` holds the policy's constructor options."""
    from cbjax.bench.online import plan_policy
    from cbjax.engine_config import EngineConfig

    variant = plain_dict((cfg.get("variants") or {}).get(name) or {})
    policy = variant.pop("policy", name)
    known = set(EngineConfig.option_defaults()) | {*DATA_PARALLEL_OPTIONS}
    unknown = sorted(set(variant) - known)
    if unknown:
        raise ValueError(f"config.variants.{name}: unknown engine option(s) {unknown}")
    options = (cfg.get("policy_options") or {}).get(name)
    plan = plan_policy(
        policy,
        static_batch_timeout_s=cfg.engine.static_batch_timeout_s,
        window_ms=cfg.time_window.window_ms,
        max_batch=cfg.time_window.max_batch,
        policy_options=None if options is None else plain_dict(options),
    )
    return plan, variant


def engine_options(cfg, name: str):
    """The PolicyPlan of one entry and its engine's options: config.engine, the entry's policy and variant, and
    (with engine.runner="sim") config.sim's cost model."""
    plan, overrides = entry_plan(cfg, name)
    options = {**cfg.engine.to_dict(), **plan.engine_options, **overrides}
    if options.get("runner") == "sim":
        sim = cfg.get("sim") or {}
        options.update(
            sim_profile=sim.get("profile"),
            sim_accelerator=sim.get("accelerator"),
            sim_num_chips=sim.get("num_chips", 1),
            sim_step_time_scale=sim.get("step_time_scale", 1.0),
        )
    return plan, options


def only_entries(cfg, names) -> None:
    """Narrow `cfg` (in place) to the policy-list entries `names`, with their policy_options: a benchmark or a check
    that runs some entries of a zoo config."""
    import ml_collections

    with cfg.unlocked():
        cfg.policies = tuple(names)
        options = (cfg.get("policy_options") or {}).items()
        cfg.policy_options = ml_collections.ConfigDict({k: v for k, v in options if k in names})


def check_sim(cfg) -> None:
    """A simulated run: a virtual clock, its step times from exactly one of config.sim.profile (a readable
    cost-model profile, or "auto": this machine's cached calibration, made by the first engine if there is none)
    and config.sim.accelerator."""
    from cbjax.sim import AUTO_PROFILE, load_profile

    if cfg.engine.get("runner", "model") != "sim":
        return
    if cfg.clock != "virtual" or cfg.step_cost_ms != 0:
        raise ValueError("config.engine.runner='sim' needs config.clock='virtual' and config.step_cost_ms=0")
    sim = cfg.get("sim") or {}
    if (sim.get("profile") is None) == (sim.get("accelerator") is None):
        raise ValueError("config.engine.runner='sim' needs exactly one of config.sim.profile, config.sim.accelerator")
    if sim.get("profile") not in (None, AUTO_PROFILE):
        load_profile(sim["profile"])  # readable, and a known kind of cost model


def plain_dict(d) -> dict:
    """A ConfigDict (nested ones too) as plain dicts: engine configs go into the JSON manifest."""
    return d.to_dict() if hasattr(d, "to_dict") else dict(d)


def resolve_config(cfg):
    """Fill what the config leaves to the run (vocabulary, clipping length) and check the policy list.

    `policies` may hold comma-separated entries (`--config.policies=fcfs,static` arrives as one string).
    `engine.policy`, when set (`--config.engine.policy=sjf`), runs that one policy instead of the list."""
    from cbjax.core.policy_zoo import POLICIES, make_policy
    from cbjax.engine_config import EngineConfig
    from cbjax.model.registry import model_config_of

    cfg = cfg.copy_and_resolve_references()
    single = cfg.engine.get("policy")
    if "policy" in cfg.engine:
        with cfg.unlocked():
            del cfg.engine["policy"]  # each entry of `policies` sets the engine's policy
    if single is not None:
        cfg.policies = (single,)
    names = [p.strip() for entry in cfg.policies for p in str(entry).split(",") if p.strip()]
    if not names:
        raise ValueError("config.policies is empty")
    if len(set(names)) != len(names):
        raise ValueError(f"config.policies lists a policy twice: {names}")
    for name in names:
        # An unknown name, variant field or policy option fails here, before any compile.
        plan, _ = entry_plan(cfg, name)
        if "policy_options" in plan.engine_options:
            make_policy(plan.engine_options["policy"], plan.engine_options["policy_options"])
    # Options of a known policy left out of the list (--config.policies=fcfs,sjf on the zoo's config) are unused;
    # a name that is no policy or variant at all is a typo.
    known = {*POLICIES, "static", "time_window", *(cfg.get("variants") or {})}
    unknown = sorted(set(cfg.get("policy_options") or {}) - set(names) - known)
    if unknown:
        raise ValueError(f"config.policy_options names policies not in config.policies: {unknown}")
    cfg.policies = tuple(names)
    for field in ("horizon_s", "horizon_after_last_arrival_s"):
        if cfg.get(field) is not None and not cfg[field] > 0:
            raise ValueError(f"config.{field} must be > 0 or None, got {cfg[field]}")
    if cfg.clock not in ("real", "virtual"):
        raise ValueError(f"config.clock must be 'real' or 'virtual', got {cfg.clock!r}")
    if cfg.step_cost_ms < 0 or (cfg.step_cost_ms > 0 and cfg.clock != "virtual"):
        raise ValueError(f"config.step_cost_ms={cfg.step_cost_ms} needs config.clock='virtual' (0 with a real clock)")
    for field in ("repeats", "seeds"):
        value = cfg.get(field, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{field} must be an integer >= 1, got {value!r}")
    if cfg.get("baseline") is not None and cfg.baseline not in names:
        raise ValueError(f"config.baseline ({cfg.baseline!r}) is not one of config.policies {names}")
    if not isinstance(cfg.get("overwrite", False), bool):
        raise ValueError(f"config.overwrite must be True or False, got {cfg.overwrite!r}")
    check_sim(cfg)
    model_config = model_config_of(cfg.model)
    for name in names:  # every entry's engine options, as its engine will get them
        options = engine_options(cfg, name)[1]
        try:
            check_data_parallel(options)
            EngineConfig.from_options({k: v for k, v in options.items() if k not in DATA_PARALLEL_OPTIONS})
        except ValueError as e:
            raise ValueError(f"config.engine (entry {name!r}): {e}") from None
    load = load_of(cfg)
    if load is not None:
        entry_plan(cfg, capacity_policy(cfg))  # an unknown reference policy fails here, before any compile
        if cfg.workload.get("request_rate") is not None:
            logging.warning(
                "workload.load=%s sets the arrival rate: workload.request_rate=%s is not used "
                "(--config.workload.load=0 to use it)",
                load,
                cfg.workload.request_rate,
            )
    if cfg.workload.vocab_size is None:
        cfg.workload.vocab_size = model_config.vocab_size
    if cfg.workload.max_model_len is None and cfg.engine.max_model_len is not None:
        cfg.workload.max_model_len = cfg.engine.max_model_len
    return cfg


def check_data_parallel(options: dict) -> None:
    """The data-parallel options of an entry (ValueError naming the problem)."""
    from cbjax.config import validation as check
    from cbjax.core.routers import make_router

    if options.get("data_parallel_size") is not None:
        check.integer("data_parallel_size", options["data_parallel_size"], 1)
    if options.get("router") is not None or options.get("router_options") is not None:
        make_router(options.get("router") or "least_load", plain_dict(options.get("router_options") or {}))
