"""``kvctl`` entry point (the implementation is in ``sidecar._kvctl``)."""

from ._kvctl import app, main

__all__ = ["app", "main"]

if __name__ == "__main__":
    main()
