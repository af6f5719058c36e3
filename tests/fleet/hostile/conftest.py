from tests.prefix.conftest import start_sims  # noqa: F401  (re-exported fixture)
