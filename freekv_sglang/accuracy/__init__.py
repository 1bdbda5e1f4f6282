"""Accuracy harness: FreeKV against dense attention, Quest-style selection and sink+window dropping
on seeded synthetic long-context tasks (see README, "Accuracy harness")."""
