"""Latest-safe-launch reorder (work in progress)."""


def install(ic) -> None:
    pass
