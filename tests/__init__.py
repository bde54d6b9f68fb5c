# Imported before any test module or conftest: kvcellar must set OMP_WAIT_POLICY before
# torch loads its OpenMP runtime (spinning threads make every test several times slower on
# a busy 2-core machine).
import kvcellar  # noqa: F401
