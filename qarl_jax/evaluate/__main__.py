import sys

from qarl_jax.evaluate.command import main
from qarl_jax.run.heap import reexec_with_tunables

if __name__ == "__main__":
    reexec_with_tunables()  # XLA:CPU's temporaries kept in the heap (see qarl_jax.run.heap)
    sys.exit(main())
