"""What every sub-config of EngineConfig shares: a frozen dataclass whose options are checked once, when it is built,
and stored as plain Python values."""

import dataclasses


class Section:
    """Base of the sub-configs. A subclass is a frozen dataclass whose `checked()` returns every field's checked
    value (raising ValueError naming the option, its value and what is allowed); `__post_init__` stores them."""

    def checked(self) -> dict:
        raise NotImplementedError

    def __post_init__(self):
        for name, value in self.checked().items():
            object.__setattr__(self, name, value)

    def replace(self, **changes):
        """A copy with some options changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))
