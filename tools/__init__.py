"""Command-line tools that call the memo_ext package."""
