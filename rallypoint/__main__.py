from rallypoint.cli import main

# Guarded: multiprocessing may import this module in helper processes.
if __name__ == "__main__":
    raise SystemExit(main())
