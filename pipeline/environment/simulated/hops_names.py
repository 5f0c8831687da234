"""The `hops` world's made-up names (pipeline/environment/simulated/hops_world.py builds the world from them).

First names by sex, surnames, countries, cities, and the two word lists each of film and book titles are
combined from (a title is one word of the first list and one of the second). The words are disjoint between
kinds and from the relation words (`hops_world.RELATION_WORDS`) and stop words, so a request's words say
which entity it names. The order of each tuple is part of the world: `World.generate` draws from them with a
seeded generator, so reordering one changes every question.
"""

MALE_NAMES = (
    "Berin",
    "Dorin",
    "Falk",
    "Hollis",
    "Jory",
    "Lorn",
    "Nils",
    "Perrin",
    "Sten",
    "Ulric",
    "Wendel",
    "Yorick",
    "Aurek",
    "Corvin",
    "Emric",
    "Garrick",
    "Ivo",
    "Kaspar",
    "Mattis",
    "Osric",
    "Radek",
    "Tobiah",
    "Valen",
    "Anselm",
)
FEMALE_NAMES = (
    "Alda",
    "Cassia",
    "Elna",
    "Gerta",
    "Ilse",
    "Kessa",
    "Mira",
    "Odile",
    "Rhosyn",
    "Tamsin",
    "Vesna",
    "Xanthe",
    "Brisa",
    "Delphine",
    "Fenna",
    "Hedda",
    "Jessamy",
    "Linnea",
    "Maelis",
    "Nerys",
    "Perpetua",
    "Solveig",
    "Thora",
    "Wilhelmina",
)
SURNAMES = (
    "Ashgrove",
    "Brackwell",
    "Corran",
    "Dunmere",
    "Elsworth",
    "Fallowby",
    "Greaves",
    "Hartsell",
    "Ivelle",
    "Jarrick",
    "Kettleby",
    "Lorimer",
    "Marchbank",
    "Nettleford",
)
COUNTRIES = ("Valdoria", "Kestrenland", "Norvane", "Aurentia", "Solvaria", "Tyrrhen")
CITIES = (
    "Velmora",
    "Tarnwick",
    "Oskeln",
    "Brevanne",
    "Caldris",
    "Dunmarrow",
    "Esketh",
    "Fjarholm",
    "Gallowen",
    "Hestria",
    "Ithmere",
    "Jorvale",
    "Kelsmoor",
    "Lunavar",
    "Morwen",
    "Nethris",
    "Orrinford",
    "Pellucia",
    "Quorlan",
    "Rusker",
    "Sablemouth",
    "Tovrin",
    "Ulveston",
    "Wyndhallow",
)
FILM_WORDS = (
    ("Silver", "Hollow", "Crimson", "Quiet", "Broken", "Golden", "Distant", "Frozen", "Velvet", "Burning"),
    ("Harbor", "Lantern", "Orchard", "Meridian", "Tide", "Compass", "Garden", "Mirror", "Bridge", "Signal"),
)
BOOK_WORDS = (
    ("Paper", "Iron", "Winter", "Amber", "Salt", "Glass", "Copper", "Midnight", "Wild", "Last"),
    ("Kingdom", "Letters", "Shore", "Hours", "Crown", "River", "Voyage", "Season", "Archive", "Promise"),
)
FILMS, BOOKS = 36, 36
