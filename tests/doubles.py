"""Test doubles shared by the test modules: small backends built on the reference maths."""
from qcore import Support
from qcore.backend.reference import ReferenceBackend


class Q8Only(ReferenceBackend):
    """A second backend for registry and cross-backend tests: the reference maths, 8-bit integers only."""

    name = "q8only"
    priority = 50

    def _supports(self, scheme):
        if scheme.bits != 8 or scheme.traits.is_float:
            return Support.no(f"{scheme.value} is not an 8-bit integer value")
        return Support.yes()


class Offline(ReferenceBackend):
    """A backend whose device is missing: installed, never available."""

    name = "offline"
    priority = 99

    def available(self):
        return False

    def describe(self):
        return "no device found (test double)"
