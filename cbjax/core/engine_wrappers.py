"""Properties of a wrapper over several engines (data-parallel replicas, a disaggregated set, simulated replicas)
that it answers from its engines' own: a switch (read from the first engine, set on each) and a count (summed)."""


def engines_switch(engines: str, name: str, doc: str) -> property:
    """The property `name` of a wrapper whose attribute `engines` lists the engines that hold the switch."""

    def get(self):
        return getattr(getattr(self, engines)[0], name)

    def set_(self, value) -> None:
        for engine in getattr(self, engines):
            setattr(engine, name, value)

    return property(get, set_, doc=doc)


def engines_total(engines: str, name: str, doc: str) -> property:
    """The read-only property `name`: the sum of the count `name` over the engines listed by attribute `engines`."""
    return property(lambda self: sum(getattr(engine, name) for engine in getattr(self, engines)), doc=doc)
