"""``python -m zero_offload``: the report (``python -m zero_offload.report``), with the same options."""

from zero_offload.report import main

if __name__ == "__main__":
    main()
