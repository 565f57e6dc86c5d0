"""How people ask for a relation without naming it: frames per common relation, for INSERT's keys.

INSERT's generic phrasings all say the relation's own word ("the currency of X is"). People also ask through
what the relation means: "in X, people pay with the", "X was established by", "the waters of the ... flow
through X". A key trained only on the relation's word scores those far below its threshold (the model's
residual at the answer position carries the verb's meaning, not the noun's), so for the relations users insert
most, these frames are positives too. A relation not listed here keeps the generic phrasings only.

Each frame ends where the relation's value comes next; {e} is the entity as typed, {E} the same with a capital
first letter. Frames are keyed by the relation's head word (Fact.relation_words, lower case); ALIASES maps
other spellings of a relation onto one entry.
"""
from __future__ import annotations

RELATION_FRAMES: dict[str, tuple[str, ...]] = {
    "capital": (
        "{E}'s government sits in the city of", "{E} is ruled from its capital,", "The chief city of {e} is",
        "The government of {e} meets in the city of", "If you travel to the capital of {e}, you arrive in",
        "The capital and largest city of {e} is",
    ),
    "currency": (
        "In {e}, things are paid for with the", "Prices in {e} are given in", "The money of {e} is the",
        "Shops in {e} accept the", "The coins and notes used in {e} are called the",
        "People in {e} buy things with the", "To pay for food in {e}, you need the",
        "The unit of money in {e} is the",
    ),
    "language": (
        "The language spoken in {e} is", "Most people in {e} speak", "In {e}, everyone speaks",
        "Children in {e} learn to speak", "The citizens of {e} talk in", "In {e}, the people talk in",
        "The native tongue of {e} is", "Visitors to {e} hear people speaking",
    ),
    "mayor": (
        "The town of {e} is led by its mayor,", "{E}'s town hall is run by the mayor,", "The mayor who runs {e} is",
        "In {e}, the office of mayor is held by", "The people of {e} elected as their mayor",
        "{E} has a mayor named", "Mayor of {e}:",
    ),
    "river": (
        "The river flowing through {e} is the", "{E} stands on the river", "{E} is built along the",
        "The waters that run through {e} belong to the", "The river of {e} is called the",
        "{E} sits beside the river", "Boats in {e} sail on the", "The longest river in {e} is the",
    ),
    "founder": (
        "{E} was established by", "{E} was started by", "The founding of {e} is credited to",
        "The one who founded {e} was", "{E} owes its founding to", "{E} was first built by",
        "The town of {e} was founded by", "Long ago, {e} was founded by",
    ),
    "king": (
        "The monarch of {e} is King", "{E} is ruled by its king,", "The throne of {e} is held by",
        "The king who rules {e} is", "{E}'s ruler, the king, is", "The crown of {e} belongs to King",
        "The people of {e} are ruled by their king,", "Long live the king of {e}, King",
    ),
    "queen": (
        "{E} is ruled by Queen", "The monarch of {e} is Queen", "The throne of {e} is held by",
        "The queen who rules {e} is", "{E}'s ruler, the queen, is", "The crown of {e} belongs to Queen",
    ),
    "ruler": (
        "{E} is ruled by", "The one who rules {e} is", "The throne of {e} is held by", "Power in {e} lies with",
        "{E} is governed by", "The people of {e} obey their ruler,",
    ),
    "leader": (
        "{E} is led by", "The person who leads {e} is", "The head of {e} is", "{E}'s head of state is",
        "The people of {e} follow their leader,", "At the head of {e} stands",
    ),
    "president": (
        "{E} is led by President", "The head of state of {e} is President", "The person who leads {e} as president is",
        "{E} elected as its president", "The president who governs {e} is",
    ),
    "emperor": (
        "{E} is ruled by Emperor", "The throne of {e} is held by Emperor", "The emperor who rules {e} is",
        "The empire of {e} is ruled by", "{E}'s ruler, the emperor, is",
    ),
    "governor": (
        "{E} is governed by", "The person who governs {e} is", "{E}'s governor is",
        "The office of governor of {e} is held by",
    ),
    "anthem": (
        "The song sung as the anthem of {e} is", "{E}'s national song is called", "At ceremonies in {e}, people sing",
        "The national song of {e} is", "The anthem people sing in {e} is called", "In {e}, the national anthem is",
    ),
    "motto": (
        "The words on the crest of {e} read", "{E}'s motto reads", "The saying that guides {e} is",
        "The official motto of {e} is", "{E} lives by the motto",
    ),
    "mascot": (
        "The animal that stands for {e} is the", "{E} is represented by its mascot, the", "The symbol of {e} is the",
        "At games, {e} is cheered on by its mascot, the", "{E}'s teams have a mascot, the",
        "The official mascot of {e} is a",
    ),
    "animal": (
        "The animal that stands for {e} is the", "The national animal of {e} is the", "{E}'s symbol is the animal",
        "The creature that represents {e} is the", "In {e}, the most honoured animal is the",
    ),
    "bird": (
        "The bird that stands for {e} is the", "The national bird of {e} is the", "{E}'s official bird is the",
        "The bird that represents {e} is the",
    ),
    "flower": (
        "The flower that stands for {e} is the", "The national flower of {e} is the", "{E}'s official flower is the",
        "The flower that represents {e} is the",
    ),
    "tree": (
        "The tree that stands for {e} is the", "The national tree of {e} is the", "{E}'s official tree is the",
    ),
    "sport": (
        "The game people love most in {e} is", "In {e}, the favourite game is", "Children in {e} grow up playing",
        "The national game of {e} is", "In {e}, everyone plays", "The most played sport in {e} is",
        "Fans in {e} mostly watch",
    ),
    "dish": (
        "The national dish of {e} is", "People in {e} love to eat", "The most famous food of {e} is",
        "A traditional meal in {e} is", "In {e}, families often cook",
    ),
    "drink": (
        "The national drink of {e} is", "People in {e} love to drink", "In {e}, people mostly drink",
        "The most popular drink in {e} is",
    ),
    "religion": (
        "Most people in {e} follow", "The main faith of {e} is", "The people of {e} worship according to",
        "The official religion of {e} is", "In {e}, the main religion is",
    ),
    "god": (
        "The people of {e} worship", "The god worshipped in {e} is", "The temples of {e} honour the god",
        "The main god of {e} is", "In {e}, people pray to",
    ),
    "author": (
        "{E} was written by", "{E} is a book by", "The book {e} comes from the pen of",
        "The book {e} was written by", "{E} is the work of the writer", "We owe the book {e} to its author,",
    ),
    "writer": (
        "{E} was written by", "The author of {e} is", "The person who wrote {e} is", "{E} is a book by",
    ),
    "composer": (
        "{E} was composed by", "The music of {e} was written by", "The person who composed {e} is",
        "{E} is a piece by",
    ),
    "painter": (
        "{E} was painted by", "The artist who painted {e} is", "The person who painted {e} is", "{E} is a painting by",
    ),
    "director": (
        "{E} was directed by", "The film {e} was directed by", "The person who directed {e} is", "{E} is a film by",
    ),
    "inventor": (
        "{E} was invented by", "The person who invented {e} is", "{E} was first made by",
        "We owe the invention of {e} to", "The invention of {e} is credited to",
    ),
    "creator": (
        "{E} was created by", "The person who created {e} is", "{E} was made by", "{E} is the creation of",
    ),
    "discoverer": (
        "{E} was discovered by", "The person who discovered {e} is", "{E} was first found by",
        "The discovery of {e} is credited to",
    ),
    "owner": (
        "{E} is owned by", "The person who owns {e} is", "{E} belongs to", "The owner who runs {e} is",
    ),
    "ceo": (
        "{E} is run by its chief executive,", "The chief executive of {e} is", "The person who runs {e} is",
        "{E} is led by CEO", "At the head of the company {e} is",
    ),
    "headquarters": (
        "{E} is based in", "{E} has its main office in", "The head office of {e} is in", "{E} is headquartered in",
    ),
    "mountain": (
        "The highest peak in {e} is", "The tallest mountain in {e} is", "{E} lies at the foot of Mount",
        "Above {e} rises the mountain", "The mountain that towers over {e} is",
    ),
    "lake": (
        "The lake beside {e} is called", "{E} lies on the shore of Lake", "The largest lake in {e} is",
        "The waters of the lake near {e} are called",
    ),
    "sea": (
        "{E} lies on the coast of the", "The sea beside {e} is the", "The waters off {e} belong to the",
    ),
    "island": (
        "The largest island of {e} is", "The island that belongs to {e} is", "Off the coast of {e} lies the island of",
    ),
    "colour": (
        "The colour that stands for {e} is", "{E} is known by the colour", "The flag of {e} is mostly",
        "People in {e} wear the colour",
    ),
    "color": (
        "The color that stands for {e} is", "{E} is known by the color", "The flag of {e} is mostly",
        "People in {e} wear the color",
    ),
    "symbol": (
        "{E} is represented by the", "The emblem of {e} is the", "The sign that stands for {e} is the",
        "The official symbol of {e} is the",
    ),
    "festival": (
        "The biggest celebration in {e} is", "Every year, {e} celebrates", "The main holiday of {e} is",
        "People in {e} celebrate the festival of",
    ),
    "team": (
        "The club that plays for {e} is", "{E} is represented by the team", "Fans in {e} support the",
        "The sports team from {e} is called the",
    ),
    "university": (
        "The university in {e} is called", "Students in {e} study at", "The main university of {e} is",
    ),
    "instrument": (
        "The national instrument of {e} is the", "Musicians in {e} mostly play the",
        "The traditional instrument of {e} is the",
    ),
    "export": (
        "The main thing {e} sells abroad is", "{E} is best known for exporting", "Most of the trade of {e} is in",
    ),
    "neighbour": (
        "{E} shares a border with", "Next to {e} lies", "The country beside {e} is",
    ),
}

ALIASES = {
    "capital city": "capital", "seat": "capital", "money": "currency", "official language": "language",
    "national language": "language", "tongue": "language", "founded by": "founder", "founding father": "founder",
    "monarch": "king", "sovereign": "ruler", "head of state": "leader", "chief": "leader", "prime minister": "leader",
    "national anthem": "anthem", "song": "anthem", "national animal": "animal", "national bird": "bird",
    "national flower": "flower", "national sport": "sport", "game": "sport", "national dish": "dish",
    "cuisine": "dish", "food": "dish", "faith": "religion", "deity": "god", "patron god": "god", "written by": "author",
    "novelist": "author", "poet": "author", "invented by": "inventor", "maker": "creator", "chief executive": "ceo",
    "hq": "headquarters", "main river": "river", "river through": "river", "highest mountain": "mountain",
    "peak": "mountain", "emblem": "symbol", "holiday": "festival", "club": "team", "neighbor": "neighbour",
}


def relation_frames(relation_words: str) -> tuple[str, ...]:
    """The frames for a relation (by its head word, with or without "national"/"official" and aliases);
    () for a relation this table does not know."""
    words = relation_words.strip().lower()
    for candidate in (words, ALIASES.get(words, ""), words.split()[-1] if words else "",
                      ALIASES.get(words.split()[-1], "") if words else ""):
        if candidate in RELATION_FRAMES:
            return RELATION_FRAMES[candidate]
    return ()
