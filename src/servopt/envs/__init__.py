"""Runtime environments: a Python environment of its own for a runtime whose build clashes with the others.

``onnxruntime``, ``onnxruntime-openvino`` and ``onnxruntime-gpu`` all install the ``onnxruntime`` module and
overwrite each other, so a runtime that needs one of the special builds runs its jobs in a virtual environment made
for it: created on first use under ``<servopt home>/envs/<name>-<key>/``, reused afterwards (``ensure_env``).

servopt is not pip-installed there: its dependencies would pull the plain ``onnxruntime`` back in over the special
build. The env gets servopt's lean core dependencies without any onnxruntime (``core_requirements``) and the
launcher puts servopt's source, and only it, on PYTHONPATH (``job_env``).

An env is complete only when its ``env.json`` exists. It is written last, inside a temporary sibling folder that is
then renamed into place, all under a per-env lock, so neither a killed creation nor two concurrent ones can leave a
half-made env that gets used.
"""


from servopt.envs.create import ensure_env, interpreter_info
from servopt.envs.inside import core_requirements, job_env, python_for, runtime_spec, servopt_src
from servopt.envs.manage import list_envs, prune
from servopt.envs.spec import ENV_FILE, STALE_TMP_S, EnvCreationError, EnvInfo, EnvSpec, ReadyEnv, env_dir, envs_root

__all__ = ["ENV_FILE", "STALE_TMP_S", "EnvCreationError", "EnvInfo", "EnvSpec", "ReadyEnv", "core_requirements", "ensure_env",
           "env_dir", "envs_root", "interpreter_info", "job_env", "list_envs", "prune", "python_for", "runtime_spec",
           "servopt_src"]
