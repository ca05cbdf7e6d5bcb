"""eagle3-pipeline: turn a served LLM into a trained, verified EAGLE-3 draft.

The library has no Prefect imports: every stage is a plain function and a CLI command
(`eagle3 ...`); `tasks/` and `flows/` wrap them for orchestration.
"""

from pathlib import Path

__version__ = "0.1.0"

PROJECT_ROOT = Path(__file__).resolve().parent.parent
