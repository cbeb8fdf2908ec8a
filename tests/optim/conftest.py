from tests.fixtures import one_thread  # noqa: F401
